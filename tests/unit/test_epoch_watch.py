"""EpochWatch: the one broker-restart detector (stage runners' commits, the ingress, the re-driver)."""

import pytest

from shared.transport.ledger import EpochWatch


@pytest.mark.asyncio
async def test_a_change_is_reported_once_and_gaps_keep_the_last_token():
    answers = [b"a", b"a", None, b"b", b"b", RuntimeError("redis away"), b"c"]

    async def read():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    watch = EpochWatch(read)
    seen = [await watch.changed() for _ in range(7)]
    # the first token is the reference; a flushed or unreachable Redis is no change
    assert seen == [False, False, False, True, False, False, True]
