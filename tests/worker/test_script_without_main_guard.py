"""A plain script that calls LLM(tensor_parallel_size=2) at its top level, without the `if __name__ == "__main__":`
guard, runs: the ranks are spawned without re-running the script (worker/local_workers.py: _script_not_rerun), so it
prints its answer once and exits 0 (before, each rank re-ran the script, multiprocessing refused to spawn inside
it, and the script died under "local rank 0 died before serving"). Also: a TP=2 answer equal to TP=1's. ~25 s."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
from shardserve import LLM, SamplingParams

print("script ran", flush=True)
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
for tp in (1, 2):
    llm = LLM(model={model!r}, tensor_parallel_size=tp, device="cpu", dtype="float32", max_model_len=128,
              num_kv_blocks=32)
    print("tokens", tp, llm.generate([[1, 5, 9, 13]], params)[0].outputs[0].token_ids, flush=True)
    llm.shutdown()
"""


def test_a_script_without_the_main_guard_runs_tensor_parallel(tiny_model, tmp_path):
    script = tmp_path / "plain_script.py"
    script.write_text(SCRIPT.format(model=tiny_model("llama")))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines.count("script ran") == 1, done.stdout  # the ranks did not run it again
    tokens = {line.split(" ", 2)[1]: line.split(" ", 2)[2] for line in lines if line.startswith("tokens ")}
    assert tokens.keys() == {"1", "2"} and tokens["1"] == tokens["2"], done.stdout
