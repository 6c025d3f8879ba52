"""Pipeline schedules as data: per-rank action lists, their text form, generators, and a
static check that simulates them before launch.

    from shardfx.schedule import one_f_one_b, check, bubble_fraction
    schedule = one_f_one_b(p=4, m=8)
    print(schedule)                    # the grid: one column per rank, one row per slot
    check(schedule, max_in_flight=4)   # raises ScheduleError on deadlock, overflow, gaps
    bubble_fraction(schedule)          # 3/8, as (p-1)/m says
"""

from shardfx.schedule.actions import Action, Kind, ScheduleError
from shardfx.schedule.check import (Costs, Span, Timeline, bubble_fraction, check, grid,
                                    in_flight, peak_in_flight, simulate)
from shardfx.schedule.lists import Schedule, with_communication
from shardfx.schedule.generate import (GENERATORS, formula_bubble, forward_only, generate,
                                       gpipe, interleaved_1f1b, one_f_one_b, zb_h1)

__all__ = [
    "Action", "Kind", "Schedule", "ScheduleError", "with_communication",
    "Costs", "Span", "Timeline", "bubble_fraction", "check", "grid", "in_flight",
    "peak_in_flight", "simulate",
    "GENERATORS", "formula_bubble", "forward_only", "generate", "gpipe", "interleaved_1f1b", "one_f_one_b", "zb_h1",
]
