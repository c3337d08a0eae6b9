"""llama-server's task queue while it decodes (patch `0071-server-queue-worker-wakes-for-work`, docs/serve.md).

llama-server runs each decode inside `server_queue::yield_to_queue`, so that a worker thread can answer `/metrics` and
`/slots` meanwhile. The main loop posts a NEXT_RESPONSE task before every decode only to keep itself going, and the
worker, which declines every task but those two, used to wake for it on every yield: two thread switches per yield,
one yield per token (two with a speculative type, whose drafters' `process` is yielded too). On the demo model on
2 cores that was 7-14 % of llama-server's decode time. The worker now wakes only for a task it may act on.

The test counts the voluntary context switches of each of the server's threads over a long greedy request
(`/proc/<pid>/task/<tid>/status`): a thread woken per yield shows at least two per token, while no thread should
switch once per token. It also asks `/metrics` during the request, the work the worker is there for.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from clover_dev.process import server_metrics
from tests.support.serve import clover_serve, post

pytestmark = pytest.mark.native

TOKENS = 512
METRICS_ASKED = 8
PROMPT = "def parse(line):\n"


def voluntary_switches(pid: int) -> dict[int, int]:
    """Voluntary context switches so far, per thread of process ``pid``."""
    counts = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
        match = re.search(r"^voluntary_ctxt_switches:\s+(\d+)$", status, re.M)
        assert match, f"/proc/{pid}/task/{task.name}/status has no voluntary_ctxt_switches"
        counts[int(task.name)] = int(match[1])
    return counts


@pytest.mark.parametrize("spec_type", ["none", "ngram-mod,draft-clover"])
def test_no_thread_wakes_per_token_and_metrics_answer_during_a_decode(demo_gguf: Path, spec_type: str) -> None:
    with clover_serve(demo_gguf, "-c", "1024", "-np", "1", "-t", "2", "--no-warmup", "--metrics",
                      "--spec-type", spec_type) as (url, proc, _):
        body = {"prompt": PROMPT, "n_predict": TOKENS, "temperature": 0.0, "ignore_eos": True, "mode": "ar"}
        status, warm = post(url + "/completion", {**body, "n_predict": 8})
        assert status == 200, warm

        metrics_answered = []
        done = threading.Event()

        def ask_metrics() -> None:  # a few times, spaced, each a task for the worker if it comes during a decode
            for _ in range(METRICS_ASKED):
                metrics_answered.append("tokens_predicted_total" in server_metrics(url))
                if done.wait(0.01):
                    return

        before = voluntary_switches(proc.pid)
        asker = threading.Thread(target=ask_metrics)
        asker.start()
        try:
            status, answer = post(url + "/completion", body)
        finally:
            done.set()
            asker.join()
        after = voluntary_switches(proc.pid)

    assert status == 200 and answer["timings"]["predicted_n"] == TOKENS, answer
    assert metrics_answered and all(metrics_answered), metrics_answered
    # each /metrics request wakes the worker and an HTTP thread a few times, not once per token
    woken = {tid: after[tid] - before.get(tid, 0) for tid in after}
    per_token = {tid: n / TOKENS for tid, n in woken.items() if n >= TOKENS}
    assert not per_token, (f"threads of llama-server (--spec-type {spec_type}) that switched at least once per "
                           f"generated token: {per_token}; every thread's switches: {woken}")

