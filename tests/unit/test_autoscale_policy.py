"""The autoscaling policy alone (shared/autoscale.py): lag sizing, the TTFT nudge, bounds and
the scale-down hysteresis."""

from shared.autoscale import Bounds, GroupScaler, p99_from_buckets

B = Bounds(min_workers=1, max_workers=4, lag_per_worker=8, ttft_slo_s=2.0, scale_down_after_s=10)


def test_scales_up_at_once_to_ceil_lag_over_threshold_within_bounds():
    s = GroupScaler(("encode",), B)
    assert s.decide(1, 0, None, 0)[0] == 1
    assert s.decide(1, 9, None, 1)[0] == 2
    assert s.decide(2, 24, None, 2)[0] == 3
    assert s.decide(3, 1000, None, 3)[0] == 4  # max


def test_ttft_above_slo_adds_a_worker_only_where_it_prefills_or_decodes_and_has_lag():
    assert GroupScaler(("decode",), B).decide(1, 3, 2.5, 0)[0] == 2
    assert GroupScaler(("decode",), B).decide(1, 0, 2.5, 0)[0] == 1  # nothing queued: more workers won't help
    # a burst's idle tail: one record in flight per worker at most; another worker would sit idle
    assert GroupScaler(("decode",), B).decide(2, 2, 2.5, 0)[0] == 2
    assert GroupScaler(("decode",), B).decide(2, 3, 2.5, 0)[0] == 3


def test_a_slow_tail_with_a_record_per_worker_scales_down_after_the_window():
    s = GroupScaler(("decode",), B)
    assert s.decide(2, 1, 2.5, 0)[0] == 2
    assert s.decide(2, 1, 2.5, 10)[0] == 1
    assert GroupScaler(("encode",), B).decide(1, 3, 2.5, 0)[0] == 1
    assert GroupScaler(("decode",), B).decide(1, 3, 1.5, 0)[0] == 1


def test_scales_down_one_worker_per_window_after_wanting_fewer_for_the_whole_window():
    s = GroupScaler(("prefill",), B)
    assert s.decide(4, 0, None, 100)[0] == 4
    assert s.decide(4, 0, None, 105)[0] == 4
    assert s.decide(4, 9, None, 106)[0] == 4  # wants 2, still fewer: the window keeps running
    assert s.decide(4, 0, None, 110)[0] == 3
    assert s.decide(3, 0, None, 115)[0] == 3  # the window starts over
    assert s.decide(3, 0, None, 120)[0] == 2


def test_a_burst_inside_the_window_resets_it():
    s = GroupScaler(("prefill",), B)
    s.decide(2, 0, None, 0)
    assert s.decide(2, 16, None, 8)[0] == 2  # wanted == current: run broken
    assert s.decide(2, 0, None, 12)[0] == 2
    assert s.decide(2, 0, None, 21)[0] == 2
    assert s.decide(2, 0, None, 22)[0] == 1


def test_p99_from_window_buckets():
    assert p99_from_buckets([]) is None
    assert p99_from_buckets([(0.1, 0), (1.0, 0), (float("inf"), 0)]) is None
    assert p99_from_buckets([(0.1, 50), (1.0, 99), (2.5, 100), (float("inf"), 100)]) == 1.0
    assert p99_from_buckets([(0.1, 50), (1.0, 98), (2.5, 100), (float("inf"), 100)]) == 2.5
