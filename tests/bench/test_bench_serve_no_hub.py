"""`bench serve` never asks a model hub for anything: against a running server whose model name is a hub id, it
builds its prompts with the network off and no offline switch set (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE unset), making
no lookup at all: token ids without a local tokenizer, text with --tokenizer PATH (a local folder). Runs in a
subprocess (the session's conftest sets the offline switches, which huggingface_hub reads once). ~10 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, socket, sys
attempts = []

def refuse(*args, **kwargs):  # the network is off: every lookup and connection fails, and is counted
    attempts.append(repr(args[:2]))
    raise OSError("the network is off")

socket.getaddrinfo = refuse
socket.socket.connect = refuse
socket.create_connection = refuse

from shardserve.bench.serve import build_requests
from shardserve.cli.main import build_parser

flags = json.loads(sys.argv[1])
args = build_parser().parse_args(["bench", "serve", "--address", "127.0.0.1:1", "--num-prompts", "3",
                                  "--input-len", "8", "--output-len", "2", *flags])
# what a running server's GetModelInfo says: its model's name, a hub id here
info = dict(model="HuggingFaceTB/SmolLM2-135M-Instruct", tp=1, replicas=1, vocab_size=49152,
            tokenizer="HuggingFaceTB/SmolLM2-135M-Instruct", eos={2}, has_chat_template=True)
requests = build_requests(args, info)
print(json.dumps({"attempts": attempts, "format": info["prompt_format"],
                  "text": all(isinstance(r.prompt, str) for r in requests)}))
"""


def _run(*flags: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                            "HF_DATASETS_OFFLINE")}
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(list(flags))], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_against_a_running_server_no_hub_lookup_token_ids_without_a_local_tokenizer():
    result = _run()
    assert result["attempts"] == [] and result["format"] == "token-ids"


def test_a_local_tokenizer_folder_gives_text_prompts_without_any_lookup(default_model_dir):
    result = _run("--tokenizer", default_model_dir, "--prompt-format", "text")
    assert result["attempts"] == [] and result["format"] == "text" and result["text"]
