"""Terminal chat over gRPC streaming: `python -m ernie_client.chat [--url localhost:8001]`.

Reasoning is printed dimmed as it arrives, then the answer; /reset clears the history, /quit leaves.
"""
from __future__ import annotations

import argparse
import json
import sys

from .triton_client import stream_generate

DIM, RESET = "\033[2m", "\033[0m"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ernie_client.chat", description=__doc__)
    p.add_argument("--url", default="localhost:8001", help="tritonserver gRPC address")
    p.add_argument("--model", default="ernie", help="ernie (ensemble) or ernie_bls")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument("--no-thinking", action="store_true", help="chat_template_kwargs enable_thinking=false")
    p.add_argument("--tools", default=None, help="a JSON file with an OpenAI tools array")
    p.add_argument("--once", default=None, help="send this one message and exit (no prompt)")
    args = p.parse_args(argv)
    tools = json.load(open(args.tools)) if args.tools else None
    color = sys.stdout.isatty()
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        if args.once is not None:
            line = args.once
        else:
            try:
                line = input("you> ").strip()
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
        if line in ("/quit", "/exit"):
            return 0
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        answer, in_reasoning = [], False
        try:
            for d in stream_generate(args.url, args.model, messages=history, tools=tools,
                                     chat_template_kwargs={"enable_thinking": False} if args.no_thinking else None,
                                     max_tokens=args.max_tokens, temperature=args.temperature):
                if d.reasoning:
                    if not in_reasoning:
                        print(DIM + "thinking: " if color else "thinking: ", end="")
                        in_reasoning = True
                    print(d.reasoning, end="", flush=True)
                if d.text or d.tool_calls:
                    if in_reasoning:
                        print(RESET if color else "", end="\n")
                        in_reasoning = False
                    print(d.text, end="", flush=True)
                    answer.append(d.text)
                    for c in d.tool_calls:
                        print(f"\n[tool call] {json.dumps(c, ensure_ascii=False)}", end="", flush=True)
                if d.finish_reason:
                    print((RESET if color and in_reasoning else "") + f"\n[{d.finish_reason}, "
                          f"{d.num_input_tokens} prompt + {d.num_output_tokens} generated tokens]")
        except KeyboardInterrupt:
            print("\n[interrupted]")
        except Exception as e:  # noqa: BLE001 - show the server's error and keep the session
            print(f"\n[error] {e}", file=sys.stderr)
            history.pop()
            if args.once is not None:
                return 1
            continue
        history.append({"role": "assistant", "content": "".join(answer)})
        if args.once is not None:
            return 0


if __name__ == "__main__":
    sys.exit(main())
