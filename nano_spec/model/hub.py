"""Model ids ("org/name") resolved through the Hugging Face cache; a download only where the network allows.

A local directory always wins over an id. Only the files nano_spec reads are fetched.
"""
import json
import re
from pathlib import Path

FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja"]
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")  # the hub's org/name


def is_model_id(model) -> bool:
    return isinstance(model, str) and REPO_ID.fullmatch(model) is not None and not Path(model).is_dir()


def missing_files(snapshot: Path) -> list:
    """The files a checkpoint needs that the snapshot lacks (a cache can hold part of a repository)."""
    missing = [f for f in ("config.json", "tokenizer.json") if not (snapshot / f).is_file()]
    index = snapshot / "model.safetensors.index.json"
    if (snapshot / "model.safetensors").is_file():
        return missing
    if not index.is_file():
        return missing + ["model.safetensors"]
    try:
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        return missing  # load_model names what is wrong with the index
    return missing + [s for s in shards if not (snapshot / s).is_file()]


def resolve(model_id: str) -> Path:
    """The snapshot directory of a model id: the local cache first, then a download unless offline."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:  # the hub's own rules (no "--" or "..", ...), which REPO_ID leaves out
        validate_repo_id(model_id)
    except HFValidationError as e:
        raise ValueError(f"model: {model_id} is not a directory and not a valid Hugging Face model id (org/name): "
                         f"{_first_line(e)}") from None
    fetch = f"get it with `hf download {model_id}` where the network allows"
    try:
        cached = Path(snapshot_download(model_id, allow_patterns=FILES, local_files_only=True))
        missing = missing_files(cached)
        if not missing:
            return cached
    except LocalEntryNotFoundError as e:  # nothing cached, or a snapshot the cache knows to be incomplete
        cached = Path(e.snapshot_path) if getattr(e, "snapshot_path", None) else None  # (recent huggingface_hub)
        missing = missing_files(cached) if cached else None
    if constants.HF_HUB_OFFLINE:
        what = f"lacks {', '.join(missing)}" if missing else "is not in the Hugging Face cache"
        raise ValueError(f"model: {model_id} is not a directory and {what} ({constants.HF_HUB_CACHE}); "
                         f"offline (HF_HUB_OFFLINE=1): {fetch}")
    lacks = f" (lacks {', '.join(missing)})" if missing else ""
    where = (f"not in the Hugging Face cache ({constants.HF_HUB_CACHE})" if cached is None
             else f"is in the Hugging Face cache ({constants.HF_HUB_CACHE}) only in part{lacks}")
    unreachable = f"model: {model_id} is not a directory, {where} and the hub cannot be reached: {fetch}"
    try:
        snapshot = Path(snapshot_download(model_id, allow_patterns=FILES))
    except LocalEntryNotFoundError:  # the hub could not be reached and nothing usable is cached
        raise ValueError(unreachable) from None
    except (OSError, ValueError) as e:  # no such repository, gated, a refused request
        raise ValueError(f"model: {model_id} is not a directory and the hub refused it ({_first_line(e)})") from None
    missing = missing_files(snapshot)
    # an unreachable hub makes snapshot_download return a partial cached snapshot as it is, without a word
    if missing and cached is not None and not _hub_answers(model_id):
        raise ValueError(unreachable)
    if missing:
        raise ValueError(f"model: {model_id} on the hub lacks {', '.join(missing)}; nano_spec needs config.json, "
                         "tokenizer.json and safetensors weights")
    return snapshot


def _hub_answers(model_id: str) -> bool:
    """Whether the hub answers a question about model_id; a refusal is an answer."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        HfApi().repo_info(model_id)
        return True
    except Exception as e:  # an HTTP refusal, or a connection error of whichever HTTP library huggingface_hub uses
        return isinstance(e, HfHubHTTPError)


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
