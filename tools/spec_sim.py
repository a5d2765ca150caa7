#!/usr/bin/env python3
"""Replays a greedy output through akunu's n-gram drafter and draft adaptivity
(crates/akunu-core/src/speculative.rs, decode.rs SpecState) with a cost model:
a plain step costs 1, a verification pass of 1 + k rows costs 1 + alpha * k.
Greedy speculative decode emits the plain output token for token, so the
drafts, accepts and steps follow from the plain output alone.

    akunu generate --prompt-file P -n 129 --ignore-eos --json > out.json
    python3 tools/spec_sim.py out.json [--alpha 0.39] [--ngram-min 2]

The prompt must be the one `akunu bench --chat` builds (the user turn without
a system message): `<|im_start|>user\\n{file}<|im_end|>\\n<|im_start|>assistant\\n`.
Prints, per policy (first draft 8 tokens = before; 1 = slow start), the
predicted speedup, drafted / accepted tokens, passes and plain steps.
"""
import argparse
import json


class Drafter:
    """The n-gram predictor: the latest earlier occurrence of the longest
    matching tail n-gram, continued with its own output."""

    def __init__(self, mn, mx, seq):
        self.mn, self.mx, self.t = mn, mx, []
        self.maps = {n: {} for n in range(mn, mx + 1)}
        for x in seq:
            self.push(x)

    def push(self, x):
        end = len(self.t)
        self.t.append(x)
        for n in range(self.mn, self.mx + 1):
            if end >= n:
                self.maps[n][tuple(self.t[end - n:end])] = end

    def propose(self, k):
        out, n_tok = [], len(self.t)
        if k == 0:
            return out
        for n in range(self.mx, self.mn - 1, -1):
            if n_tok < n:
                continue
            e = self.maps[n].get(tuple(self.t[n_tok - n:]))
            if e is None or e >= n_tok:
                continue
            for j in range(k):
                i = e + j
                out.append(self.t[i] if i < n_tok else out[i - n_tok])
            return out
        return out


def simulate(prompt, gen, alpha, first_draft, draft=8, mn=2, mx=4):
    misses_to_pause, pause_min, pause_max = 2, 4, 128
    k_cur, misses, pause_left, pause_len = min(first_draft, draft), 0, 0, pause_min
    hist = list(prompt) + [gen[0]]
    pred = Drafter(mn, mx, hist)
    done, cost = 1, 0.0
    drafted = accepted = passes = plain = 0
    while done < len(gen):
        for x in hist[len(pred.t):]:
            pred.push(x)
        want = len(gen) - done
        d = pred.propose(min(k_cur, want - 1, 15)) if pause_left == 0 else []
        if pause_left > 0 or not d:
            n = min(want, max(pause_left, 1))
            hist += gen[done:done + n]
            done += n
            cost += n
            plain += n
            pause_left = max(0, pause_left - n)
            continue
        k, m = len(d), 0
        while m < k and done + m < len(gen) and d[m] == gen[done + m]:
            m += 1
        emit = min(m + 1, len(gen) - done)
        hist += gen[done:done + emit]
        done += emit
        cost += 1 + alpha * k
        passes += 1
        drafted += k
        accepted += m
        k_cur = min(draft, k_cur * 2) if m == k else max(1, min(draft, m + 1))
        if m == 0:
            misses += 1
            if misses >= misses_to_pause:
                misses, pause_left = 0, pause_len
                pause_len = min(pause_len * 2, pause_max)
        else:
            misses, pause_len = 0, pause_min
    return {
        "speedup": round((len(gen) - 1) / cost, 3),
        "drafted": drafted,
        "accepted": accepted,
        "passes": passes,
        "plain_steps": plain,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", nargs="+", help="outputs of akunu generate --json")
    ap.add_argument("--alpha", type=float, default=0.39, help="cost of an extra verified row, in one-row steps")
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--draft", type=int, default=8)
    a = ap.parse_args()
    for f in a.json:
        d = json.load(open(f))
        for first in (a.draft, 1):
            r = simulate(d["prompt_ids"], d["generated_ids"], a.alpha, first, a.draft, a.ngram_min, a.ngram_max)
            print(f"{f}: first draft {first}: {r}")


if __name__ == "__main__":
    main()
