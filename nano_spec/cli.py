"""What the command-line tools (generate, bench) share: checks of their arguments, each error a ValueError that
names the flag."""
import json


def check_threads(threads):
    from nano_spec.engine.threads import MAX_THREADS  # the engine's bound, named by the flag; imported late, as
                                                      # it imports torch and --help stays instant
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"--threads: must be an integer in [1, {MAX_THREADS}] (4 per CPU core), got {threads}")


def read_file(flag: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8-sig") as f:  # a byte order mark some editors write is not text
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path} ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{flag}: {path} is not UTF-8 text") from None


def read_schema(path: str) -> dict:
    try:
        return json.loads(read_file("--json-schema", path))
    except json.JSONDecodeError as e:
        raise ValueError(f"--json-schema: {path} is not JSON ({e})") from None
