from exporter.command.cli import main

# Guarded: a job's worker process (multiprocessing's spawn) may import this module again.
if __name__ == "__main__":
    main()
