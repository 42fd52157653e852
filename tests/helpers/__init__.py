"""What tests share, under one import path (`from helpers import X`): tests import helpers, never each other.

models: small real models, the in-process server, float64 references; checks: comparisons against them;
heads: models with transformed logits; servers: servers as processes and their memory; wire: raw requests;
venvs: fresh virtual environments (torch installed once per session); ranks: gloo ranks in spawned processes;
fp8: FP8 checkpoints quantized by hand beside their dequantized float models."""
from .models import *  # noqa: F401,F403  (every public name, including ones added later)
from .checks import (FIELDS, PACKED_ATOL, TOL, assert_close, assert_same_signature, check_ranks,  # noqa: F401
                     random_request, separated, within_packed_bound)
from .heads import build_transformed_head, check_every_output  # noqa: F401
from .servers import OVERHEAD, CliServer, Rss, TorchrunServer, serve_dir  # noqa: F401
from .wire import kserve_request, kserve_tensor, post  # noqa: F401
from .venvs import copy_venv, make_venv, pip_install, python_of  # noqa: F401
from .ranks import run_ranks  # noqa: F401
from .fp8 import quant_config, quantize, quantize_dir, rewrite  # noqa: F401
