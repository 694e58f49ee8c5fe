"""One module (or subpackage) per runtime, each with `load(path, device) -> Loaded`."""
