"""The anchors' loss-spike rules, reimplemented from their descriptions as small pure functions.

Each takes a sequence of loss values (in log order) and returns the positions where the rule acts (kills,
skips or reruns a step). They see the loss only: non-finite values are passed over, as their projects
handle NaN elsewhere.

  olmo      OLMo-core / levanter: the loss above mean + 6 sd of the last 128 losses (the step is skipped
            and does not enter the statistics); from 20 losses on
  foundry   llm-foundry KillLossSpike: the loss >= 2x the mean of the last 100 for more than 4 steps
  metaseq   metaseq: loss / EWM(span 9) of the loss > 1.5
  megatron  Megatron-LM: the loss above 10x the largest of the first 100 values
"""
from __future__ import annotations

import math
from collections import deque
from typing import Callable, Iterable

AnchorRule = Callable[[Iterable[float]], list[int]]


def olmo(losses: Iterable[float]) -> list[int]:
    window: deque[float] = deque(maxlen=128)
    total = total_sq = 0.0
    out = []
    for i, x in enumerate(losses):
        if not math.isfinite(x):
            continue
        n = len(window)
        if n >= 20:
            mean = total / n
            sd = math.sqrt(max(0.0, total_sq / n - mean * mean))
            if x > mean + 6 * sd:
                out.append(i)
                continue      # the step is skipped: its loss does not enter the statistics
        if n == window.maxlen:
            old = window[0]
            total -= old
            total_sq -= old * old
        window.append(x)
        total += x
        total_sq += x * x
    return out


def foundry(losses: Iterable[float]) -> list[int]:
    window: deque[float] = deque(maxlen=100)
    run, out = 0, []
    for i, x in enumerate(losses):
        if not math.isfinite(x):
            continue
        if len(window) == window.maxlen and x >= 2 * (sum(window) / len(window)):
            run += 1
            if run > 4:
                out.append(i)
                run = 0
            continue
        run = 0
        window.append(x)
    return out


def metaseq(losses: Iterable[float]) -> list[int]:
    alpha = 2 / (9 + 1)
    ewm: float | None = None
    out = []
    for i, x in enumerate(losses):
        if not math.isfinite(x):
            continue
        if ewm is not None and x / ewm > 1.5:
            out.append(i)
        ewm = x if ewm is None else alpha * x + (1 - alpha) * ewm
    return out


def megatron(losses: Iterable[float]) -> list[int]:
    first: list[float] = []
    out = []
    for i, x in enumerate(losses):
        if not math.isfinite(x):
            continue
        if len(first) < 100:
            first.append(x)
        elif x > 10 * max(first):
            out.append(i)
    return out


ANCHORS: dict[str, AnchorRule] = {
    "OLMo 6 sigma(128)": olmo,
    "llm-foundry 2x mean(100) >4 steps": foundry,
    "metaseq loss/EWM(9) > 1.5": metaseq,
    "Megatron 10x max(first 100)": megatron,
}
