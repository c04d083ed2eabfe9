"""The token ids the simulated backend hands back: fixed text in ERNIE-4.5-Thinking's output shape (reasoning, then
`</think>`, then a `<response>` block or a `<tool_call>` block; English, CJK and characters only byte-fallback
pieces spell), tokenized once with the served tokenizer, so the detokenizer and the parsers do their real work.

A request's output replays one document from its first token to the EOS that ends it (then, under ignore_eos, the
next document). Which document, and where its output starts, is fixed the first time the request samples (from its
last prompt ids and their position, whatever the prefill's chunking or prefix-cache hits) and remembered by the
request's row key: a row's id then depends on its request
and position only, so a preempted request recomputed later, or a step replayed, gives the same stream. The memory is
bounded (SimulationConstants.replay_memo_entries, oldest first out); a request outliving that many newer ones
restarts its replay at its next sample, which only changes the text it gets.
"""
from __future__ import annotations

import zlib

import numpy as np

from ..step_contract import StepInput

DOCUMENTS = (
    "The user wants to know how long the trip from Beijing to Shanghai takes. Let me think about the options. "
    "The high-speed train (G-series) covers about 1,318 km; the fastest ones take roughly 4 hours 18 minutes, most "
    "take 5 to 6 hours. A flight is about 2 hours 15 minutes in the air, but with the trip to the airport, security "
    "and boarding it is closer to 4 or 5 hours door to door. Driving is about 12 hours without long stops. So the "
    "train is usually the best balance of time and comfort, and it arrives in the city centre.\n</think>\n\n"
    "<response>\nFrom Beijing to Shanghai:\n\n1. **High-speed train**: 4 h 18 min on the fastest G trains, 5-6 h "
    "on most; stations are central (Beijing South to Shanghai Hongqiao).\n2. **Flight**: about 2 h 15 min in the "
    "air, 4-5 h door to door once you count security and transfers.\n3. **Car**: about 12 hours over 1,200 km of "
    "expressway.\n\nFor most travellers the train is the fastest door to door.\n</response>",

    "用户问的是如何在家里做一道简单的番茄炒蛋。我需要给出材料、步骤和一些小技巧。材料：两个番茄、三个鸡蛋、盐、糖、"
    "葱花和食用油。步骤上，先把鸡蛋打散加一点盐，热锅凉油把鸡蛋炒到半凝固盛出；再炒番茄出汁，加少许糖中和酸味，"
    "最后把鸡蛋倒回去翻炒均匀，撒上葱花。要注意火候，鸡蛋不要炒老。\n</think>\n\n<response>\n"
    "**番茄炒蛋（两人份）**\n\n材料：番茄 2 个、鸡蛋 3 个、盐 1 小勺、糖半小勺、葱花少许。\n\n"
    "1. 鸡蛋打散，加一小撮盐；番茄切块。\n2. 热锅凉油，倒入蛋液，炒至七成熟盛出。\n"
    "3. 锅中再加少许油，放番茄翻炒出汁，加糖和剩下的盐。\n4. 倒回鸡蛋，翻炒 30 秒，撒葱花出锅。\n\n"
    "小技巧：番茄先用开水烫一下去皮，口感更好。\n</response>",

    "The user asks for the weather in Hangzhou tomorrow and whether to bring an umbrella. I do not know tomorrow's "
    "forecast myself; there is a get_weather tool that takes a city and a date. Tomorrow relative to the current "
    "date in the system prompt is 2025-06-12. I should call the tool with city 杭州 and that date, in Celsius, and "
    "answer about the umbrella once the result comes back.\n</think>\n\n<tool_call>\n"
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"杭州\", \"date\": \"2025-06-12\", "
    "\"unit\": \"celsius\"}}\n</tool_call>",

    "They want a short, friendly birthday message for a colleague who loves hiking and photography, with a couple "
    "of emoji. Keep it warm but not too personal since it is for work. Maybe mention mountains and the perfect shot. "
    "Emoji: 🎂 🏔️ 📷 ✨. Also add a line in Japanese since the colleague is from Osaka: お誕生日おめでとう. And a "
    "rare character or two would be fun: 𝄞 for music, 𠀋 just for style? No, keep it readable.\n</think>\n\n"
    "<response>\nHappy birthday, Aiko! 🎂\n\nMay this year bring you new trails to climb 🏔️, clear skies at every "
    "summit and the perfect light for every shot 📷. Thank you for the photos that brighten our team chat ✨.\n\n"
    "お誕生日おめでとうございます！ Enjoy your day!\n</response>",

    "The user asks for a Python function that returns the n-th Fibonacci number efficiently. Recursion without "
    "memoization is exponential. An iterative loop is O(n) and O(1) memory, which is enough for most uses; matrix "
    "exponentiation or fast doubling gives O(log n). I'll show the iterative version and mention fast doubling. "
    "Handle n < 0 by raising ValueError.\n</think>\n\n<response>\nHere is an iterative version, O(n) time and O(1) "
    "memory:\n\n```python\ndef fibonacci(n: int) -> int:\n    if n < 0:\n        raise ValueError(\"n must be >= 0\")\n"
    "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n```\n\n`fibonacci(10)` returns "
    "55. For very large n, the fast-doubling method (F(2k) = F(k)(2F(k+1) - F(k)), F(2k+1) = F(k)^2 + F(k+1)^2) "
    "takes O(log n) steps.\n</response>",
)
HASHED_IDS = 8  # a request's last prompt ids that choose its document (the last chunk holds them but for tiny chunks)
FIXED_PATTERN_LENGTH = 255  # ids a fixed-pattern document has before its EOS (skip_tokenizer_init)


class Replay:
    """The replayed stream (documents' ids, each ending with EOS, back to back) and where each request reads it."""

    def __init__(self, stream: np.ndarray, doc_starts: np.ndarray, memo_entries: int):
        self.stream = np.ascontiguousarray(stream, dtype=np.int64)
        self.doc_starts = np.asarray(doc_starts, dtype=np.int64)
        self.memo_entries = memo_entries
        self._base: dict[int, int] = {}  # row key -> stream index of position 0 (insertion order: oldest first)

    @classmethod
    def from_tokenizer(cls, tokenizer, eos_token_id: int, memo_entries: int) -> "Replay":
        """DOCUMENTS tokenized by the served tokenizer (added tokens such as </think> as the tokenizer has them)."""
        docs = [tokenizer.encode(text) + [eos_token_id] for text in DOCUMENTS]
        return cls._concatenated(docs, memo_entries)

    @classmethod
    def fixed_pattern(cls, vocab_size: int, eos_token_ids: list[int], memo_entries: int) -> "Replay":
        """Without a tokenizer (skip_tokenizer_init): one document of ids walking the upper half of the vocabulary
        (special tokens sit low in ERNIE's vocabularies), none of them an EOS, then the first EOS."""
        first, span = vocab_size // 2, max(1, min(vocab_size // 2, 1000))
        ids = [first + (7 * j) % span for j in range(FIXED_PATTERN_LENGTH)]
        return cls._concatenated([[i for i in ids if i not in eos_token_ids] + [eos_token_ids[0]]], memo_entries)

    @classmethod
    def _concatenated(cls, docs: list[list[int]], memo_entries: int) -> "Replay":
        starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
        return cls(np.concatenate([np.asarray(d, dtype=np.int64) for d in docs]), starts, memo_entries)

    def ids(self, step: StepInput) -> np.ndarray:
        """The id each of step.sample_rows gets: the token after its position in its request's replay."""
        rows = step.sample_rows
        if not rows.size:
            return np.zeros(0, dtype=np.int64)
        seqs = np.searchsorted(step.query_start_loc, rows, side="right") - 1
        nexts = step.positions[rows] + 1
        keys = step.row_keys[seqs].tolist()
        memo = self._base
        bases = list(map(memo.get, keys))  # one pass in C: this runs on the engine's thread every step
        if None in bases:
            for i, key in enumerate(keys):
                if bases[i] is None:
                    bases[i] = memo[key] = self._start(step, int(seqs[i]), int(rows[i])) - int(nexts[i])
                    if len(memo) > self.memo_entries:
                        del memo[next(iter(memo))]
        return self.stream[(np.array(bases, dtype=np.int64) + nexts) % self.stream.size]

    def _start(self, step: StepInput, seq: int, row: int) -> int:
        """The stream index a request's first output token reads: a document's first id, chosen by the last
        HASHED_IDS ids up to its sampled row and that row's position (so different prompts read different
        documents)."""
        lo = max(int(step.query_start_loc[seq]), row + 1 - HASHED_IDS)
        key = np.append(step.token_ids[lo:row + 1], step.positions[row]).astype(np.int64)
        return int(self.doc_starts[zlib.crc32(key.tobytes()) % self.doc_starts.size])
