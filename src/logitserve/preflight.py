"""Start-up checks before anything loads or any rank starts, each failing with one line that says what to do."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional


class StartupError(ValueError):
    """A configuration that cannot serve; its message is the whole story (no traceback needed)."""


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_model_dir(path: Optional[str]) -> None:
    """--model names a local Hugging Face directory with config.json and weights (serving never downloads)."""
    if path is None:
        return
    p = Path(path)
    if not p.exists():
        if _HUB_ID.match(path) and not path.startswith((".", "/")):
            raise StartupError(f"--model {path}: no such local directory. Serving is offline and never downloads; "
                               f"if this is a Hugging Face Hub id, download it first, e.g. `hf download {path} "
                               f"--local-dir ./{path.split('/')[-1]}`, then pass --model ./{path.split('/')[-1]}")
        raise StartupError(f"--model {path}: no such directory")
    if not p.is_dir():
        raise StartupError(f"--model {path}: not a directory (give the directory holding config.json and "
                           f"*.safetensors)")
    config = p / "config.json"
    if not config.is_file():
        raise StartupError(f"--model {path}: no config.json in it; a Hugging Face model directory holds "
                           f"config.json and *.safetensors (`logitserve export-demo DIR` writes an example)")
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise StartupError(f"--model {path}: config.json is not readable JSON ({e})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise StartupError(f"--model {path}: config.json has no model_type; is this a transformers model directory?")
    if not any(p.glob("*.safetensors")):
        hint = " (only *.bin: convert to safetensors)" if any(p.glob("*.bin")) else ""
        raise StartupError(f"--model {path}: no weights (*.safetensors) in it{hint}")


def check_quantization(path: Optional[str]) -> None:
    """An FP8 checkpoint logitserve serves, or one line naming what it does not (logitserve.quant): the
    quantization_config and every FP8 tensor's scale, from config.json and the safetensors headers only."""
    if path is None:
        return
    from .checkpoint import Checkpoint
    from .quant import QuantError, scheme_of

    data = json.loads((Path(path) / "config.json").read_text())
    qc = data.get("quantization_config") or (data.get("text_config") or {}).get("quantization_config")
    try:
        scheme = scheme_of(qc)
    except QuantError as e:
        raise StartupError(f"--model {path}: {e}") from None
    try:
        Checkpoint(Path(path), scheme)
    except QuantError as e:            # names the directory and the tensor
        raise StartupError(str(e)) from None


def check_layout(path: Optional[str], demo: str, demo_shape: str, tp: int, cp: int, pp: int = 1) -> None:
    """tp x cp x pp must split this model: checked from its config before any rank starts."""
    if tp < 1 or cp < 1 or pp < 1:
        raise StartupError(f"--tp {tp}, --cp {cp} and --pp {pp} must be >= 1")
    if tp == 1 and pp == 1:
        return
    from .tp_plan import check_layout as check_tp

    if path is None:
        from .demo import demo_config

        config = demo_config(demo, demo_shape)
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, local_files_only=True)
    layers = int(getattr(config.get_text_config(), "num_hidden_layers", 0) or 0)
    if pp > 1 and layers < pp:
        raise StartupError(f"--pp {pp}: config.num_hidden_layers={layers}; each stage needs at least one layer")
    try:
        if tp > 1:
            check_tp(config, tp)
    except ValueError as e:
        raise StartupError(str(e)) from None


# The oldest versions the server is tested on (CI: torch 2.13, transformers 5.20.2 and 5.25; the lent GPU image's
# torch 2.11 through bench/gpu_check.sh, carrying transformers 5.20.2 since its own 5.17 is older).
MIN_VERSIONS = {"torch": (2, 11), "transformers": (5, 20)}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:2])


def check_versions(installed: Optional[dict] = None) -> None:
    """torch and transformers at least MIN_VERSIONS, or one line naming the version needed and how to get it."""
    if installed is None:
        import torch
        import transformers

        installed = {"torch": torch.__version__, "transformers": transformers.__version__}
    for name, floor in MIN_VERSIONS.items():
        if _version(installed[name]) < floor:
            need = ".".join(map(str, floor))
            raise StartupError(f"{name} {installed[name]} is installed; logitserve needs {name} >= {need} "
                               f"(pip install '{name}>={need}'; on a machine without an index, carry its wheel: "
                               f"bench/gpu_wheels.sh)")
