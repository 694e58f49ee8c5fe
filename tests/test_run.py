"""`python -m runtimes.run BUNDLE generate` on the bundle of an ExecuTorch job of a tiny Llama's
GGUF file, which carries its tokenizer (a byte vocabulary and a chat template) as standard files:
its greedy tokens are transformers' generate's on the same file, a seeded sampling repeats, it
stops at the manifest's EOS ids, and bad input gets one line naming it, exit 2."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

from runtimes import run
from runtimes.formats import bundle as bundles
from tests import gguf_checkpoint
from tests.conftest import PROJECT_ROOT, job_in_process

# A prefill of up to 24 tokens (a chat turn's 21), a cache of 32 slots.
SEQ_MAX, SLOTS = 24, 32
# "Hello", a byte per token.
HELLO = [72, 101, 108, 108, 111]
# What a bare target lacks: generating from token ids needs none of them.
NOT_ON_TARGET = "exporter,transformers,tokenizers,hydra,omegaconf,mlflow"
FIGURES = re.compile(
    r"\[generate\] prompt (?P<prompt>\d+) tokens, generated (?P<generated>\d+) "
    r"\((?P<how>[^)]*)\), prefill (?P<prefill_ms>[\d.]+) ms, decode (?P<decode_ms>[\d.]+) "
    r"ms/token \(median of (?P<steps>\d+) steps\)"
)


@dataclass(frozen=True)
class Generated:
    """What `generate` printed: its first line, the new tokens (text, or ids with commas), and
    its figures."""

    header: str
    printed: str
    figures: dict[str, str]

    @property
    def ids(self) -> list[int]:
        return [int(token) for token in self.printed.split(",")]


def generate(bundle: Path, *args: str, blocked: str | None = None) -> Generated:
    """`python -m runtimes.run BUNDLE generate ARGS` in a process of its own, which must succeed;
    with `blocked`, on a target that cannot import those packages (tests/bare_target.py)."""
    runner = ["-m"] if blocked is None else ["tests/bare_target.py", blocked]
    completed = subprocess.run(
        [sys.executable, *runner, "runtimes.run", str(bundle), "generate", *args],
        cwd=PROJECT_ROOT,
        capture_output=True,
    )
    # Bytes: universal newlines would turn a generated carriage return into a newline.
    stdout, stderr = completed.stdout.decode(), completed.stderr.decode()
    assert completed.returncode == 0, stdout + stderr
    return parsed(stdout)


def generate_here(capfd: pytest.CaptureFixture[str], bundle: Path, *args: str) -> Generated:
    """`generate` in this process, which has torch and the runtime loaded already: a second
    instead of a process's five."""
    code = run.main([str(bundle), "generate", *args])
    captured = capfd.readouterr()
    assert code == 0, captured.out + captured.err
    return parsed(captured.out)


def parsed(stdout: str) -> Generated:
    header, rest = stdout.split("\n", 1)
    printed, last = rest.removesuffix("\n").rsplit("\n", 1)
    found = FIGURES.fullmatch(last)
    assert found is not None, last
    return Generated(header, printed, found.groupdict())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("checkpoint")
    return gguf_checkpoint.write(gguf_checkpoint.tiny_llama(), folder / "tiny.F32.gguf")


@pytest.fixture(scope="module")
def bundle(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("executorch") / "run"
    record, _ = job_in_process(
        run_dir,
        "backend=executorch",
        "model=llama",
        f"model.checkpoint={checkpoint}",
        "model.kv_cache=static",
        f"dynamic.seq.max={SEQ_MAX}",
        f"model.max_cache_len={SLOTS}",
    )
    assert record.error is None, record.error
    return run_dir / "bundle"


@pytest.fixture(scope="module")
def eager(checkpoint: Path) -> tuple[transformers.PreTrainedTokenizerBase, torch.nn.Module]:
    """The checkpoint's tokenizer and model as transformers reads them, in float32."""
    where = {"gguf_file": checkpoint.name}
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint.parent, **where)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint.parent, dtype=torch.float32, **where
    )
    return tokenizer, model.eval()


def transformers_greedy(model: torch.nn.Module, prompt: list[int], count: int) -> list[int]:
    """transformers' greedy generate after `prompt`: `count` tokens, or fewer where it stops at
    the checkpoint's EOS."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=count,
            do_sample=False,
            pad_token_id=gguf_checkpoint.EOS_ID,
        )
    return out[0, len(prompt) :].tolist()


def test_the_bundle_carries_the_tokenizer_as_files_and_the_runner_metadata(bundle: Path) -> None:
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["format"] == 3
    assert manifest["tokenizer"] == "tokenizer"
    # The GGUF file's vocabulary and chat template, as save_pretrained writes them.
    written = sorted(path.name for path in (bundle / "tokenizer").iterdir())
    assert written == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    for name in written:
        entry, path = manifest["files"][f"tokenizer/{name}"], bundle / "tokenizer" / name
        assert entry["bytes"] == path.stat().st_size
        assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert gguf_checkpoint.CHAT_TEMPLATE in (bundle / "tokenizer/chat_template.jinja").read_text()
    metadata = manifest["runner_metadata"]
    assert metadata["get_max_context_len"] == SLOTS
    assert metadata["get_max_seq_len"] == SEQ_MAX
    assert metadata["get_vocab_size"] == gguf_checkpoint.VOCAB_SIZE
    assert metadata["get_eos_ids"] == [gguf_checkpoint.EOS_ID]


def test_a_bundle_written_again_replaces_its_tokenizer(bundle: Path, tmp_path: Path) -> None:
    # The repair stage writes the job's bundle again, into the same folder.
    job = bundles.read(bundle)
    again = tmp_path / "bundle"

    def save_tokenizer(folder: Path) -> None:
        # Refuses a folder that is there: the first bundle's must have gone.
        shutil.copytree(bundle / "tokenizer", folder)

    def write() -> bundles.Bundle:
        return bundles.write(
            again,
            [job.artifact_path],
            bundle / "goldens.pt",
            job.runtime,
            job.device,
            job.output_names,
            job.shapes,
            job.executions,
            job.tolerances,
            job.source,
            job.sessions,
            job.runner_metadata,
            save_tokenizer,
        )

    write()
    written = write()
    assert written == bundles.read(again)
    assert written.files == job.files


def test_greedy_text_is_transformers_generate_on_the_same_checkpoint(
    bundle: Path, eager: tuple
) -> None:
    tokenizer, model = eager
    prompt = tokenizer.encode("Hello")
    expected = transformers_greedy(model, prompt, 12)
    found = generate(bundle, "--prompt", "Hello", "--max-new-tokens", "12")
    assert found.printed == tokenizer.decode(expected, skip_special_tokens=True)
    assert found.header == (
        f"[generate] model.pte on executorch (cpu), a cache of {SLOTS} slots: "
        f"{len(prompt)} prompt tokens, up to 12 new, greedy"
    )
    figures = found.figures
    assert (int(figures["prompt"]), int(figures["generated"])) == (len(prompt), len(expected))
    assert figures["how"] == "greedy"
    assert int(figures["steps"]) == len(expected) - 1
    assert float(figures["prefill_ms"]) > 0 and float(figures["decode_ms"]) > 0


def test_a_chat_prompt_is_a_user_turn_in_the_tokenizers_template(
    bundle: Path, eager: tuple
) -> None:
    tokenizer, model = eager
    turn = [{"role": "user", "content": "Hi"}]
    prompt = tokenizer.apply_chat_template(turn, add_generation_prompt=True)["input_ids"]
    assert len(prompt) == 21
    # No --max-new-tokens: as many as the cache holds after the prompt, up to 32.
    expected = transformers_greedy(model, prompt, SLOTS - len(prompt))
    found = generate(bundle, "--prompt", "Hi", "--chat")
    assert found.printed == tokenizer.decode(expected, skip_special_tokens=True)
    assert int(found.figures["prompt"]) == 21
    assert int(found.figures["generated"]) == len(expected) == 11


def test_token_ids_generate_ids_on_a_target_without_transformers_or_the_exporter(
    bundle: Path, eager: tuple
) -> None:
    _, model = eager
    count = SLOTS - len(HELLO)
    found = generate(
        bundle,
        "--ids",
        ",".join(map(str, HELLO)),
        "--max-new-tokens",
        str(count),
        blocked=NOT_ON_TARGET,
    )
    assert found.ids == transformers_greedy(model, HELLO, count)
    assert int(found.figures["generated"]) == len(found.ids) == count


def test_sampling_repeats_with_its_seed_and_top_k_1_is_greedy(
    bundle: Path, eager: tuple, capfd: pytest.CaptureFixture[str]
) -> None:
    tokenizer, _ = eager
    hello = ",".join(map(str, HELLO))
    seeded = ("--temperature", "1", "--seed", "7")
    sampled = generate(bundle, "--prompt", "Hello", *seeded)
    assert sampled.figures["how"] == "sampled at temperature 1, seed 7"
    # Again in this process, and from the prompt's ids: the same draws.
    assert generate_here(capfd, bundle, "--prompt", "Hello", *seeded).printed == sampled.printed
    drawn = generate_here(capfd, bundle, "--ids", hello, *seeded)
    assert len(drawn.ids) == SLOTS - len(HELLO)
    assert tokenizer.decode(drawn.ids, skip_special_tokens=True) == sampled.printed
    # Another seed draws other tokens.
    other = generate_here(capfd, bundle, "--ids", hello, "--temperature", "1", "--seed", "8")
    assert other.ids != drawn.ids
    greedy = generate_here(capfd, bundle, "--ids", hello)
    assert drawn.ids != greedy.ids
    top_1 = generate_here(
        capfd, bundle, "--ids", hello, "--temperature", "1", "--top-k", "1", "--seed", "3"
    )
    assert top_1.ids == greedy.ids
    assert top_1.figures["how"] == "sampled at temperature 1, top-k 1, seed 3"


def test_generation_stops_at_the_manifests_eos_ids(
    bundle: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    hello = ",".join(map(str, HELLO))
    greedy = generate_here(capfd, bundle, "--ids", hello).ids
    # The fourth token named the model's EOS: generation stops where it first comes.
    stop = greedy[3]
    copied = Path(shutil.copytree(bundle, tmp_path / "bundle"))
    manifest = json.loads((copied / "manifest.json").read_text())
    manifest["runner_metadata"]["get_eos_ids"] = [stop]
    (copied / "manifest.json").write_text(json.dumps(manifest))
    found = generate_here(capfd, copied, "--ids", hello)
    assert found.ids == greedy[: greedy.index(stop) + 1]
    assert found.figures["how"] == f"greedy, stopped at EOS {stop}"
    assert int(found.figures["generated"]) == len(found.ids)


@pytest.fixture(scope="module")
def without_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundle of an eager job of a checkpoint of weights alone: no tokenizer to carry."""
    folder = tmp_path_factory.mktemp("weights")
    gguf_checkpoint.tiny_llama().save_pretrained(folder / "checkpoint")
    run_dir = folder / "run"
    record, _ = job_in_process(
        run_dir,
        "backend=eager",
        "model=llama",
        f"model.checkpoint={folder / 'checkpoint'}",
        "model.kv_cache=static",
        "dynamic.seq.max=8",
        "model.max_cache_len=16",
        "validate.sampled_positions=0",
    )
    assert record.error is None, record.error
    return run_dir / "bundle"


@pytest.fixture(scope="module")
def without_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("mlp") / "run"
    record, _ = job_in_process(run_dir, "backend=eager", "model=mlp")
    assert record.error is None, record.error
    return run_dir / "bundle"


def test_a_bundle_without_a_tokenizer_generates_from_ids_and_refuses_a_prompt(
    without_tokenizer: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    manifest = json.loads((without_tokenizer / "manifest.json").read_text())
    assert manifest["tokenizer"] is None and not (without_tokenizer / "tokenizer").exists()
    assert sorted(manifest["files"]) == ["goldens.pt", "program.pt2"]
    # As many as its cache of 16 slots holds after the prompt.
    found = generate_here(capfd, without_tokenizer, "--ids", "1,2,3")
    assert len(found.ids) == int(found.figures["generated"]) == 13
    assert run.main([str(without_tokenizer), "generate", "--prompt", "Hello"]) == 2
    assert capfd.readouterr().err == (
        "[generate] --prompt: the bundle has no tokenizer (model=llama was exported without "
        "one): give the prompt's token ids with --ids 1,2,3\n"
    )


# A bad input: the bundle (made from the job's) and the arguments, and the line expected.
Case = Callable[[Path, Path], tuple[Path, list[str], str]]


def _missing(bundle: Path, tmp_path: Path) -> tuple[Path, list[str], str]:
    return tmp_path / "nowhere", ["--ids", "1"], r"nowhere/manifest\.json: no such file"


def _changed_tokenizer(bundle: Path, tmp_path: Path) -> tuple[Path, list[str], str]:
    copied = Path(shutil.copytree(bundle, tmp_path / "bundle"))
    with (copied / "tokenizer/tokenizer.json").open("a") as file:
        file.write(" ")
    expected = r"tokenizer/tokenizer\.json: \d+ bytes where the bundle's manifest says \d+"
    return copied, ["--prompt", "Hello"], expected


def _without_chat_template(bundle: Path, tmp_path: Path) -> tuple[Path, list[str], str]:
    copied = Path(shutil.copytree(bundle, tmp_path / "bundle"))
    (copied / "tokenizer/chat_template.jinja").unlink()
    manifest = json.loads((copied / "manifest.json").read_text())
    del manifest["files"]["tokenizer/chat_template.jinja"]
    (copied / "manifest.json").write_text(json.dumps(manifest))
    return copied, ["--prompt", "Hi", "--chat"], r"--chat: .* has no chat template"


def _as_given(arguments: list[str], expected: str) -> Case:
    return lambda bundle, tmp_path: (bundle, arguments, expected)


REFUSED: dict[str, Case] = {
    "missing bundle": _missing,
    "changed tokenizer file": _changed_tokenizer,
    "no chat template": _without_chat_template,
    "prompt beyond a prefill": _as_given(
        ["--ids", ",".join(["65"] * (SEQ_MAX + 1))],
        rf"--ids: {SEQ_MAX + 1} tokens, and the artifact's prefill takes at most {SEQ_MAX} "
        r"\(its dynamic.seq.max\)",
    ),
    "new tokens beyond the cache": _as_given(
        ["--ids", "72,101", "--max-new-tokens", "31"],
        rf"--max-new-tokens 31: the cache has {SLOTS} slots and the prompt takes 2, leaving 30: "
        r"ask for at most 30",
    ),
    "no new token": _as_given(["--ids", "72", "--max-new-tokens", "0"], "at least 1"),
    "ids not numbers": _as_given(["--ids", "72,x"], r"--ids 72,x: not token ids"),
    "ids outside the vocabulary": _as_given(
        ["--ids", "72,260,999"], r"--ids: 260, 999 outside the vocabulary's ids 0\.\.259"
    ),
    "chat with ids": _as_given(["--ids", "72", "--chat"], r"--chat puts --prompt"),
    "top-k when greedy": _as_given(["--ids", "72", "--top-k", "5"], r"give --temperature"),
    "negative temperature": _as_given(["--ids", "72", "--temperature", "-1"], r"0 or above"),
}


@pytest.mark.parametrize("case", REFUSED.values(), ids=REFUSED.keys())
def test_bad_input_is_one_line_naming_it_exit_2(
    case: Case, bundle: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    folder, arguments, expected = case(bundle, tmp_path)
    assert run.main([str(folder), "generate", *arguments]) == 2
    captured = capfd.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("[generate] ") and re.search(expected, line), line


def test_an_artifact_its_runtime_cannot_load_exits_5_naming_why(
    bundle: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    arguments = ["generate", "--ids", "72", "--device", "cuda"]
    assert run.main([str(bundle), *arguments]) == 5
    (line,) = capfd.readouterr().err.splitlines()
    assert line == (
        f"[generate] cannot load {bundle / 'model.pte'} (runtime executorch) on cuda: "
        "ValueError: a .pte of the XNNPACK delegate runs on the CPU, not on cuda"
    )


def test_a_bundle_without_a_kv_cache_names_what_to_export_in_its_own_process(
    without_cache: Path,
) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "runtimes.run", str(without_cache), "generate", "--ids", "1"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 2
    assert completed.stdout == ""
    assert completed.stderr == (
        f"[generate] {without_cache}: a bundle of model=mlp without a KV cache; generate "
        "continues a causal LM exported with one: export it with model.kv_cache=static\n"
    )
