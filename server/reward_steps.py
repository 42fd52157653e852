"""Process reward models on /get_reward: the step separators of a request, and each query's reward and step scores.

A token-classification PRM scores each step at its separator token; a query's reward is the last step's score
(the last label's raw score at the last separator, as a sequence classifier's reward is its last label's), and
its step scores (the last label's at every separator, in order) go to OpenRLHF's extra_logs. No math here: the
scores come from the engine (Job.step_scores).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from logitserve.errors import InvalidRequest
from logitserve.spec import OutputKind, StepOpts

from .http_common import Ctx

FIELD = "step_separator_ids"


def separators(ctx: Ctx, body: dict) -> StepOpts:
    """The body's step_separator_ids, else the server's --step-separator; neither: 400 naming the field."""
    given: Any = body.get(FIELD)
    if given is None:
        if not ctx.loaded.step_separator:
            raise InvalidRequest(FIELD, "this process reward model's server has no --step-separator: name the token "
                                        "id(s) that end a step")
        return StepOpts(tuple(ctx.loaded.step_separator))
    if not isinstance(given, list) or not given:
        raise InvalidRequest(FIELD, "a non-empty list of token ids is needed")
    ids = ctx.ids(given, FIELD)
    for j, x in enumerate(ids.tolist()):
        if not 0 <= x < ctx.loaded.vocab_size:
            raise InvalidRequest(f"{FIELD}[{j}]", f"token id {x} is outside [0, {ctx.loaded.vocab_size})")
    return StepOpts(tuple(int(x) for x in ids))


def check_steps(steps: StepOpts, seqs: tuple, where: str) -> None:
    """Every query holds a separator: one without has no step to score (400 naming the query)."""
    for i, seq in enumerate(seqs):
        if not steps.positions(seq).size:
            raise InvalidRequest(f"{where}[{i}]", f"holds none of the step separator ids {list(steps.separators[:8])} "
                                                  f"({FIELD} or --step-separator): it has no step to score")


def step_rewards(out, n: int) -> tuple[list[float], list[list[float]]]:
    """(each query's reward: its last step's last-label score, each query's last-label score at every step)."""
    steps = [np.asarray(out.of(OutputKind.STEP_SCORES, i))[:, -1].astype(np.float64).tolist() for i in range(n)]
    return [s[-1] for s in steps], steps


def extra_logs(steps: list[list[float]]) -> dict:
    """OpenRLHF's extra_logs: one entry per query under each key (a list of step scores, a count)."""
    return {"step_scores": steps, "num_steps": [len(s) for s in steps]}
