"""Pipeline schedules, tested in their text form.

The generated grids for p=4 ranks and m=8 microbatches are written out below and compared
literally: each is the published figure redrawn with every action one slot wide (GPipe and
1F1B: Narayanan et al. 2021, figures 3 and 4 top; interleaved 1F1B with v=2: figure 4 bottom;
ZB-H1: Qi et al. 2023, figure 3). Every generated schedule round-trips through both text forms,
passes the static check, and simulates to its published bubble. Hand-written schedules that
deadlock, overflow a memory budget, or miss or repeat an action are rejected, naming the rank
and the action, with the schedule printed and the bad spot marked.
"""

from __future__ import annotations

import pytest

from shardfx.schedule import (GENERATORS, Action, Costs, Kind, Schedule, ScheduleError,
                              bubble_fraction, check, formula_bubble, generate, gpipe,
                              interleaved_1f1b, one_f_one_b, peak_in_flight, simulate,
                              with_communication, zb_h1)

GPIPE = """\
    rank 0  rank 1  rank 2  rank 3
 0  0F0     -       -       -
 1  0F1     1F0     -       -
 2  0F2     1F1     2F0     -
 3  0F3     1F2     2F1     3F0
 4  0F4     1F3     2F2     3F1
 5  0F5     1F4     2F3     3F2
 6  0F6     1F5     2F4     3F3
 7  0F7     1F6     2F5     3F4
 8  -       1F7     2F6     3F5
 9  -       -       2F7     3F6
10  -       -       -       3F7
11  -       -       -       3B0
12  -       -       2B0     3B1
13  -       1B0     2B1     3B2
14  0B0     1B1     2B2     3B3
15  0B1     1B2     2B3     3B4
16  0B2     1B3     2B4     3B5
17  0B3     1B4     2B5     3B6
18  0B4     1B5     2B6     3B7
19  0B5     1B6     2B7     -
20  0B6     1B7     -       -
21  0B7     -       -       -
"""

ONE_F_ONE_B = """\
    rank 0  rank 1  rank 2  rank 3
 0  0F0     -       -       -
 1  0F1     1F0     -       -
 2  0F2     1F1     2F0     -
 3  0F3     1F2     2F1     3F0
 4  -       -       -       3B0
 5  -       -       2B0     3F1
 6  -       1B0     2F2     3B1
 7  0B0     1F3     2B1     3F2
 8  0F4     1B1     2F3     3B2
 9  0B1     1F4     2B2     3F3
10  0F5     1B2     2F4     3B3
11  0B2     1F5     2B3     3F4
12  0F6     1B3     2F5     3B4
13  0B3     1F6     2B4     3F5
14  0F7     1B4     2F6     3B5
15  0B4     1F7     2B5     3F6
16  -       1B5     2F7     3B6
17  0B5     -       2B6     3F7
18  -       1B6     -       3B7
19  0B6     -       2B7     -
20  -       1B7     -       -
21  0B7     -       -       -
"""

INTERLEAVED = """\
    rank 0  rank 1  rank 2  rank 3
 0  0F0     -       -       -
 1  0F1     1F0     -       -
 2  0F2     1F1     2F0     -
 3  0F3     1F2     2F1     3F0
 4  4F0     1F3     2F2     3F1
 5  4F1     5F0     2F3     3F2
 6  4F2     5F1     6F0     3F3
 7  4F3     5F2     6F1     7F0
 8  0F4     5F3     6F2     7B0
 9  0F5     1F4     6B0     7F1
10  0F6     5B0     6F3     7B1
11  4B0     1F5     6B1     7F2
12  0F7     5B1     2F4     7B2
13  4B1     1F6     6B2     7F3
14  -       5B2     2F5     7B3
15  -       1F7     6B3     3F4
16  4F4     5B3     2F6     3B0
17  4B2     5F4     2B0     3F5
18  4F5     1B0     2F7     3B1
19  4B3     5F5     2B1     3F6
20  4F6     1B1     6F4     3B2
21  0B0     5F6     2B2     3F7
22  4F7     1B2     6F5     3B3
23  0B1     5F7     2B3     7F4
24  0B2     1B3     6F6     7B4
25  0B3     -       6B4     7F5
26  -       5B4     6F7     7B5
27  4B4     -       6B5     7F6
28  -       5B5     -       7B6
29  4B5     -       6B6     7F7
30  -       5B6     -       7B7
31  4B6     -       6B7     3B4
32  -       5B7     2B4     3B5
33  4B7     1B4     2B5     3B6
34  0B4     1B5     2B6     3B7
35  0B5     1B6     2B7     -
36  0B6     1B7     -       -
37  0B7     -       -       -
"""

ZB_H1 = """\
    rank 0  rank 1  rank 2  rank 3
 0  0F0     -       -       -
 1  0F1     1F0     -       -
 2  0F2     1F1     2F0     -
 3  0F3     1F2     2F1     3F0
 4  -       -       -       3B0
 5  -       -       2B0     3F1
 6  -       1B0     2F2     3B1
 7  0B0     1F3     2B1     3F2
 8  0W0     1B1     2F3     3B2
 9  0F4     1W0     2B2     3F3
10  0B1     1F4     2W0     3B3
11  0W1     1B2     2F4     3W0
12  0F5     1W1     2B3     3F4
13  0B2     1F5     2W1     3B4
14  0W2     1B3     2F5     3W1
15  0F6     1W2     2B4     3F5
16  0B3     1F6     2W2     3B5
17  0W3     1B4     2F6     3W2
18  0F7     1W3     2B5     3F6
19  0B4     1F7     2W3     3B6
20  0W4     1B5     2F7     3W3
21  0B5     1W4     2B6     3F7
22  0W5     1B6     2W4     3B7
23  0B6     1W5     2B7     3W4
24  0W6     1B7     2W5     3W5
25  0B7     1W6     2W6     3W6
26  0W7     1W7     2W7     3W7
"""



def assert_grid(schedule: Schedule, expected: str) -> None:
    """``str(schedule) == expected``; else both grids, the first differing row marked."""
    got, want = str(schedule).splitlines(), expected.rstrip("\n").splitlines()
    if got == want:
        return
    bad = next(n for n in range(max(len(got), len(want)))
               if n >= len(got) or n >= len(want) or got[n] != want[n])
    mark = lambda lines: "\n".join(  # noqa: E731
        f"{'>>' if n == bad else '  '} {line}" for n, line in enumerate(lines))
    pytest.fail(f"grid differs at line {bad}\n--- got\n{mark(got)}\n--- expected\n{mark(want)}")


@pytest.mark.parametrize("schedule, expected", [
    (gpipe(4, 8), GPIPE), (one_f_one_b(4, 8), ONE_F_ONE_B),
    (interleaved_1f1b(4, 8, 2), INTERLEAVED), (zb_h1(4, 8), ZB_H1),
], ids=["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_grids_match_the_published_schedules(schedule, expected):
    assert_grid(schedule, expected)
    assert Schedule.parse(expected) == schedule


def test_grids_match_torch_pipelining_orders():
    """Cross-check against torch.distributed.pipelining's own generators (private API)."""
    from types import SimpleNamespace

    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    gpipe_cls = torch_schedules.ScheduleGPipe
    orders = {"gpipe": gpipe_cls._get_pipeline_order(
        SimpleNamespace(_num_stages=4, _n_microbatches=8))}
    for name, cls, v in [("interleaved", torch_schedules.ScheduleInterleaved1F1B, 2),
                         ("zb-h1", torch_schedules.ScheduleInterleavedZeroBubble, 1)]:
        state = SimpleNamespace(n_local_stages=v, pp_group_size=4, _n_microbatches=8,
                                microbatches_per_round=4)
        orders[name] = {r: cls._calculate_single_rank_operations(state, r) for r in range(4)}
    ours = {"gpipe": gpipe(4, 8), "interleaved": interleaved_1f1b(4, 8, 2), "zb-h1": zb_h1(4, 8)}
    for name, order in orders.items():
        theirs = [" ".join(str(a).replace("I", "B") for a in order[r]  # torch's I is our split B
                           if a is not None and a.computation_type.value in "FBIW")
                  for r in range(4)]
        assert theirs == [" ".join(map(str, acts)) for acts in ours[name].actions], name


@pytest.mark.parametrize("text", ["0F1", "1B0", "0W2", "2SEND_F1", "3RECV_F1", "3SEND_B1",
                                  "2RECV_B1", "12F105"])
def test_action_text_round_trips(text):
    assert str(Action.parse(text)) == text


def test_action_fields_and_peer():
    assert Action.parse("2SEND_F1") == Action(2, Kind.SEND_F, 1, peer_stage=3)
    assert Action.parse("2RECV_B1").peer_stage == 3 and Action.parse("1B0").peer_stage is None
    for text in ["F1", "0X1", "0F", "-1F0"]:
        with pytest.raises(ScheduleError, match="is not an action"):
            Action.parse(text)
    with pytest.raises(ScheduleError, match="stage 0 has no previous stage"):
        Action.parse("0RECV_F0")
    with pytest.raises(ScheduleError, match="talks to stage 3"):
        Action(2, Kind.SEND_F, 1, peer_stage=1)


def _generated():
    for p in (1, 2, 3, 4):
        for m in (1, 2, 4, 8):
            for name in GENERATORS:
                if name != "interleaved-1f1b":
                    yield name, p, m, 1
                elif m % p == 0:
                    yield from ((name, p, m, v) for v in (2, 3))


@pytest.mark.parametrize("name, p, m, v", list(_generated()))
def test_generated_schedules_round_trip_and_pass_check(name, p, m, v):
    schedule = generate(name, p, m, v)
    for s in (schedule, with_communication(schedule)):
        assert Schedule.parse(str(s)) == s
        assert Schedule.parse(s.format_lists()) == s
        check(s, max_in_flight=max(peak_in_flight(s).values()))
        assert bubble_fraction(s) == pytest.approx(bubble_fraction(schedule))  # comm costs 0


@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2),
                                     ("interleaved-1f1b", 4), ("zero-bubble", 1)])
@pytest.mark.parametrize("costs", [Costs(), Costs(forward=1, backward=3, weight=1),
                                   Costs(forward=2, backward=3, weight=1),
                                   Costs(forward=1, backward=1.6, weight=0.4)])
@pytest.mark.parametrize("send_early", [False, True])
def test_simulated_bubble_equals_formula(name, v, costs, send_early):
    for p in range(1, 7):
        for m in range(p, 17, p if v > 1 else 1):  # zero-bubble's formula needs m >= p
            got = bubble_fraction(generate(name, p, m, v), costs, send_early=send_early)
            want = formula_bubble(name, p, m, v, costs, send_early=send_early)
            assert got == pytest.approx(want), (p, m)


def test_early_input_gradient_shrinks_the_bubble():
    """B sending its input gradient before W: 1F1B's bubble at F = W = B/2 is 2/3 of (p-1)/m;
    each B's gradient leaves after its first half."""
    assert bubble_fraction(one_f_one_b(4, 8), send_early=True) == pytest.approx(3 / 8 * 2 / 3)
    timeline = simulate(one_f_one_b(2, 2), Costs(), send_early=True)
    starts = {str(s.action): s.start for s in timeline.spans}
    assert starts["0B0"] == starts["1B0"] + 1  # half of 1B0's 2
    with pytest.raises(ScheduleError, match="send_early needs Costs"):
        simulate(one_f_one_b(2, 2), lambda a: 1.0, send_early=True)


def test_transfers_lengthen_every_steady_1f1b_cycle_not_only_the_fill():
    """In 1F1B's steady state a rank's next forward input comes from a neighbour that first
    waited for this rank's backward output: each cycle waits for a gradient's and an
    activation's transfer (2t), so they add at least (m - p) 2t, not only the fill and
    drain's (p - 1) 2t (sc21-1t's bubble, 20% of its step at p=64, m=512, where (p-1)/m is 12%)."""
    p, m, t = 4, 16, 0.25
    durations = lambda a: 1.0 if a.kind is Kind.F else 2.0  # noqa: E731
    plain = simulate(one_f_one_b(p, m), durations).makespan
    late = simulate(one_f_one_b(p, m), durations, transfer=lambda a: t).makespan
    assert plain == (m + p - 1) * 3.0
    assert late > plain + (p - 1) * 2 * t  # more than the fill and drain's
    assert plain + (m - p) * 2 * t <= late <= (m + p - 1) * (3.0 + 2 * t)


def test_bubbles_for_p4_m8():
    assert bubble_fraction(one_f_one_b(4, 8)) == pytest.approx(3 / 8)      # (p-1)/m
    assert bubble_fraction(gpipe(4, 8)) == pytest.approx(3 / 8)
    assert bubble_fraction(interleaved_1f1b(4, 8, 2)) == pytest.approx(3 / 16)  # (p-1)/(vm)
    assert bubble_fraction(zb_h1(4, 8)) == pytest.approx(3 / 8 / 3)       # a third of 1F1B's


def test_simulated_times():
    timeline = simulate(Schedule.parse("rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1 1B1"))
    starts = {str(s.action): (s.start, s.end) for s in timeline.spans}
    assert starts["1F0"] == (1, 2) and starts["1B0"] == (2, 4) and starts["0B0"] == (4, 6)
    assert starts["1F1"] == (4, 5)  # 1F1 ran after 1B0, in rank 1's order
    assert starts["0B1"] == (7, 9)  # waits for 1B1, which ends at 7
    assert timeline.makespan == 9 and timeline.compute(rank=0) == 6
    assert bubble_fraction(timeline) == pytest.approx(1 / 2)  # (2 * 9 - 12) / 12 = (p-1)/m


def test_in_flight_peaks():
    assert peak_in_flight(one_f_one_b(4, 8)) == {0: 4, 1: 3, 2: 2, 3: 1}  # p on rank 0
    assert peak_in_flight(gpipe(4, 8)) == {0: 8, 1: 8, 2: 8, 3: 8}        # m everywhere
    assert peak_in_flight(zb_h1(4, 8)) == {0: 4, 1: 4, 2: 4, 3: 4}        # ZB-H1: p, freed at W
    assert peak_in_flight(one_f_one_b(4, 2)) == {0: 2, 1: 2, 2: 2, 3: 1}  # m < p is allowed


def test_capped_1f1b_trades_memory_for_bubble():
    """``in_flight=k``: at most k per rank, deadlock-free, a longer step the smaller k is."""
    assert one_f_one_b(4, 8, in_flight=4) == one_f_one_b(4, 8)
    steps = []
    for k in (4, 3, 2, 1):
        s = one_f_one_b(4, 8, in_flight=k)
        assert peak_in_flight(s) == {r: min(k, 4 - r) for r in range(4)}
        steps.append(check(s).makespan)
    assert steps == sorted(steps) and len(set(steps)) == 4, steps
    assert steps[-1] == 8 * 4 * 3  # one at a time: every stage's F and B in turn, 8 times


def test_memory_budget_names_rank_and_action():
    check(one_f_one_b(4, 8), max_in_flight=4)
    with pytest.raises(ScheduleError) as err:
        check(gpipe(4, 8), max_in_flight=4)
    message = str(err.value)
    assert "rank 0 holds 5 microbatches' activations after 0F4" in message
    assert " 4  >>0F4<<  1F3" in message  # the whole grid, the bad spot marked


DEADLOCK = """\
rank 0: 0F0 0B0 0F1 0B1
rank 1: 1F0 1F1 1B0 1B1
"""  # rank 0 waits for 1B0 before sending 0F1; rank 1 waits for 0F1 before running 1B0


def test_deadlock_names_ranks_and_actions():
    with pytest.raises(ScheduleError) as err:
        check(Schedule.parse(DEADLOCK))
    message = str(err.value)
    assert "deadlocks" in message
    assert "rank 0 is blocked at 0B0 (action 1), waiting for 1B0 (rank 1, action 2)" in message
    assert "rank 1 is blocked at 1F1 (action 1), waiting for 0F1 (rank 0, action 2)" in message
    assert "stuck  >>0B0<<  >>1F1<<" in message
    assert Schedule.parse(err.value.grid) == Schedule.parse(DEADLOCK)  # the marked grid parses


def test_deadlock_between_receives():
    both_receive_first = Schedule.parse("""\
rank 0: 0F0 0RECV_B0 0SEND_F0 0B0
rank 1: 1RECV_F0 1F0 1B0 1SEND_B0
""")
    with pytest.raises(ScheduleError, match=r"rank 0 is blocked at 0RECV_B0 .* 1SEND_B0 "
                                            r"\(rank 1, action 3\)") as err:
        check(both_receive_first)
    assert "rank 1 is blocked at 1RECV_F0 (action 0), waiting for 0SEND_F0" in str(err.value)


@pytest.mark.parametrize("text, message", [
    ("rank 0: 0F0 0B0 0F0\nrank 1: 1F0 1B0", "rank 0 runs 0F0, but it already ran as action 0"),
    ("rank 0: 0F0 0B0 0F1\nrank 1: 1F0 1B0 1F1 1B1", "missing: 0B1"),
    ("rank 0: 0F0 0B0 1F0\nrank 1: 1B0", "rank 0 runs 1F0, but stage 1 lives on rank 1"),
    ("rank 0: 0F0 0W0\nrank 1: 1F0 1B0 1W0", "missing: 0B0"),
    ("rank 0: 0F0 0B0\nrank 1: 1F0 1SEND_F0 1B0", "stage 1 has no neighbour 2"),
])
def test_malformed_schedules_are_rejected(text, message):
    with pytest.raises(ScheduleError, match=message):
        check(Schedule.parse(text))


def test_with_communication():
    schedule = with_communication(one_f_one_b(2, 2))
    assert schedule.format_lists() == (
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1\n"
        "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1")
    assert not with_communication(interleaved_1f1b(1, 2, 2)).has_communication  # one rank
    with pytest.raises(ScheduleError, match="already has send/recv"):
        with_communication(schedule)


@pytest.mark.parametrize("call, message", [
    (lambda: interleaved_1f1b(4, 6, 2), "m=6 is not a multiple of p=4"),
    (lambda: interleaved_1f1b(4, 8, 1), "v >= 2"),
    (lambda: one_f_one_b(0, 8), "p \\(ranks\\) must be a positive integer, got 0"),
    (lambda: gpipe(4, 2.5), "m \\(microbatches\\) must be a positive integer"),
    (lambda: one_f_one_b(4, 8, in_flight=0), "in_flight must be a positive integer, got 0"),
    (lambda: generate("looped-bfs", 4, 8), "unknown schedule 'looped-bfs'"),
    (lambda: generate("1f1b", 4, 8, v=2), "1f1b has one stage per rank, got v=2"),
    (lambda: Schedule.parse("rank 1: 1F0"), "expected 'rank 0: ...'"),
    (lambda: Schedule.parse("   rank 0  rank 1\n0  0F0"), "row has 1 cells for 2 ranks"),
])
def test_bad_input_is_named(call, message):
    with pytest.raises(ScheduleError, match=message):
        call()
