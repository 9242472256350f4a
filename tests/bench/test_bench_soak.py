"""`shardserve bench soak` at a CI size: it starts `shardserve serve` (a tiny random Llama at TP=2, no tokenizer, so
prompts go as token ids and stop strings as stop token ids), sends 200 requests of every kind while one worker
rank is SIGKILLed, and passes only with nothing lost, every invalid request answered with its status, greedy and
seeded streams equal to their undisturbed reference, no KV block left in use and serve exiting 0. `make soak` is
the same command at 10,000 requests and three kills on the default model."""

from __future__ import annotations

import json

from shardserve.bench.soak_requests import EXPECTED
from shardserve.cli.main import main as cli


def test_bench_soak_kills_a_rank_mid_run_and_loses_nothing_answers_every_status_and_leaks_no_block(tiny_model,
                                                                                                    tmp_path):
    model = tiny_model("llama", num_heads=4, num_kv_heads=2)
    out = tmp_path / "soak.json"
    assert cli(["bench", "soak", "--model", model, "--device", "cpu", "--tp", "2", "--max-model-len", "256",
                "--num-kv-blocks", "64", "--max-num-seqs", "16", "--requests", "200", "--kills", "1", "--pool", "4",
                "--concurrency", "8", "--memory-interval", "1", "--json-out", str(out)]) == 0
    record = json.loads(out.read_text())
    notes = record["notes"]
    assert record["benchmark"] == "soak" and record["tp"] == 2
    assert notes["passed"] and notes["problems"] == {} and notes["examples"] == []
    assert sum(notes["outcomes"].values()) == 200
    kinds = {key.split()[0] for key in notes["outcomes"]}
    assert {"greedy", "seeded", "stop", "unseeded", "cancel", "deadline"} <= kinds
    assert kinds & set(EXPECTED), "no invalid request was sent"
    # every invalid kind got its one status; cancels were cancelled; a deadline request finished or ran out of time;
    # every other kind finished as asked
    valid = {"cancel": {"cancelled"}, "deadline": {"ok", "DEADLINE_EXCEEDED"}}
    for key, count in notes["outcomes"].items():
        kind, outcome = key.split()
        assert outcome in ({EXPECTED[kind]} if kind in EXPECTED else valid.get(kind, {"ok"})), key
    (kill,) = notes["kills"]
    assert kill["not_serving_after_s"] is not None and kill["serving_again_s"] is not None
    assert notes["leftover"]["kv_blocks_used"] == 0 and notes["leftover"]["num_running"] == 0
    assert notes["serve_exit_code"] == 0
    memory = notes["memory"]  # sampled over time: serve, the controller, the worker ranks (none while a group restarts)
    assert len(memory) >= 2 and memory[0]["serve"]["pss_mb"] > 0 and memory[-1]["workers"]["processes"] == 2
