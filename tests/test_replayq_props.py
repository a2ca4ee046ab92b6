"""Property tests (hypothesis): random append/pop/ack/purge/reopen runs of ReplayQ agree with a list model.

The model is a list of the items of the current incarnation, the number acked (a prefix, since acks are
cumulative) and the number handed out. A reopen keeps the unacked items in disk and offload mode and
nothing in memory-only and volatile offload mode.
"""

from __future__ import annotations

import tempfile
from collections import deque
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ecq.events.replayq import AckRef, ReplayQ

MODES = {
    "memory": {},
    "disk": {"offload": False},
    "offload": {"offload": True},
    "volatile": {"offload": "volatile"},
}
KEEPS_UNACKED = {"disk", "offload"}
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

item_lists = st.lists(st.binary(max_size=40), min_size=1, max_size=4)
limits = st.tuples(st.none() | st.integers(1, 5), st.none() | st.integers(1, 100))
appends = st.tuples(st.just("append"), item_lists)
pops = st.tuples(st.just("pop"), limits)
acks = st.tuples(st.just("ack"), st.integers(0, 50))
operations = st.lists(
    st.one_of(
        appends, appends, pops, pops, acks, acks,
        st.tuples(st.just("bogus_ack"), st.none()),
        st.tuples(st.just("reopen"), st.none()),
        st.tuples(st.just("purge"), st.none()),
    ),
    max_size=60,
)


def open_queue(mode: str, root: Path, **options) -> ReplayQ:
    config = dict(MODES[mode], **options)
    if mode != "memory":
        config.update(dir=root, seg_bytes=120, fsync="never")
    return ReplayQ.open(config)


def expected_batch(pending: list[bytes], count_limit: int | None, bytes_limit: int | None) -> list[bytes]:
    batch: list[bytes] = []
    for item in pending:
        if count_limit is not None and len(batch) == count_limit:
            break
        if batch and bytes_limit is not None and sum(map(len, batch)) + len(item) > bytes_limit:
            break
        batch.append(item)
    return batch


class Model:
    def __init__(self) -> None:
        self.items: list[bytes] = []
        self.acked = 0
        self.handed = 0
        self.refs: list[tuple[AckRef, int]] = []  # (ref, items handed out up to and including its batch)

    def unpopped(self) -> list[bytes]:
        return self.items[self.handed :]

    def restart(self, keeps_unacked: bool) -> None:
        self.items = self.items[self.acked :] if keeps_unacked else []
        self.acked = self.handed = 0
        self.refs = []


@pytest.mark.parametrize("mode", MODES)
@SETTINGS
@given(ops=operations)
def test_replayq_agrees_with_a_list_model(tmp_path, mode, ops):
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    q = open_queue(mode, root)
    model = Model()
    try:
        for op, arg in ops:
            if op == "append":
                q.append(arg)
                model.items += arg
            elif op == "pop":
                expected = expected_batch(model.unpopped(), *arg)
                ref, got = q.pop(*arg)
                assert got == expected
                model.handed += len(got)
                if got:
                    model.refs.append((ref, model.handed))
            elif op == "ack" and model.refs:
                ref, end = model.refs[arg % len(model.refs)]
                q.ack(ref)
                model.acked = max(model.acked, end)
            elif op == "bogus_ack":
                with pytest.raises(ValueError):
                    q.ack(AckRef(10**9, 1))
            elif op == "reopen":
                q.close()
                q = open_queue(mode, root)
                model.restart(mode in KEEPS_UNACKED)
                if mode != "memory":
                    assert len(list(root.glob("*.seg"))) <= len(model.items)
            elif op == "purge":
                q.purge()
                model.acked = model.handed = len(model.items)
            assert q.count() == len(model.unpopped())
            assert q.bytes() == sum(map(len, model.unpopped()))
        assert q.pop()[1] == model.unpopped()
    finally:
        q.close()


@pytest.mark.parametrize("mode", ["memory", "disk", "offload"])
@SETTINGS
@given(
    ops=st.lists(
        st.one_of(st.tuples(st.just("append"), item_lists), st.tuples(st.just("pop"), limits), st.just(("ack", None))),
        max_size=40,
    )
)
def test_overload_drops_the_oldest_unpopped_items_and_counts_them(tmp_path, mode, ops):
    limit = 100
    q = open_queue(mode, Path(tempfile.mkdtemp(dir=tmp_path)), max_total_bytes=limit)
    unpopped: deque[bytes] = deque()
    dropped = [0, 0]
    last_ref = None
    try:
        for op, arg in ops:
            if op == "append":
                q.append(arg)
                unpopped.extend(arg)
                while sum(map(len, unpopped)) > limit:
                    item = unpopped.popleft()
                    dropped[0] += 1
                    dropped[1] += len(item)
                assert q.bytes() <= limit
            elif op == "pop":
                last_ref, got = q.pop(*arg)
                expected = expected_batch(list(unpopped), *arg)
                assert got == expected
                for _ in got:
                    unpopped.popleft()
            elif last_ref is not None:
                q.ack(last_ref)
            assert tuple(q.overflow_dropped()) == tuple(dropped)
            assert (q.count(), q.bytes()) == (len(unpopped), sum(map(len, unpopped)))
    finally:
        q.close()
