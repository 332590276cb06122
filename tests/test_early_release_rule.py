"""The profiler's rule for which saved Values are an Op's early releases (issue 18).

A stage's prediction is its natural peak (what the allocator saw in the profile, autograd
freeing saved Values as it goes) plus the bytes of each early release a schedule holds past the
stage. The rule must make that prediction safe for every set of held Values, and exact when the
held Values were all freed before the natural peak."""

from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from monetlike.profile.records import early_releases


def true_peak(levels, frees, held) -> int:
    """The stage's peak when the Values `held` are not freed: each adds its bytes from its free
    on."""
    extra = [0] * len(levels)
    for pos, tag, nbytes in frees:
        if tag in held:
            for q in range(pos + 1, len(levels)):
                extra[q] += nbytes
    return max(a + b for a, b in zip(levels, extra))


def test_a_second_peak_after_a_free_makes_the_value_an_early_release():
    # Found by the fuzzer: a mul's backward makes two gradients (the peak), autograd frees its
    # saved operand, then an out-of-place gradient sum climbs back to the same level. Holding the
    # operand past the stage raises that second peak by its bytes.
    levels = [0, 2048, 4096, 2048, 4096, 2048, 0]
    frees = [(3, "operand", 2048)]
    assert early_releases(levels, frees) == ["operand"]
    assert true_peak(levels, frees, {"operand"}) == 4096 + 2048


def test_a_value_freed_after_the_last_climb_is_not():
    levels = [0, 2048, 4096, 2048, 0]
    frees = [(3, "late", 2048), (1, "first", 1024)]
    assert early_releases(levels, frees) == ["first"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 64), min_size=1, max_size=12).flatmap(
    lambda levels: st.tuples(
        st.just(levels),
        st.lists(st.tuples(st.integers(0, len(levels) - 1), st.integers(1, 40)),
                 max_size=4))))
def test_safe_for_every_held_set_and_exact_for_values_freed_before_the_peak(case):
    levels, raw = case
    frees = [(pos, f"v{i}", nbytes) for i, (pos, nbytes) in enumerate(raw)]
    early = set(early_releases(levels, frees))
    natural = max(levels)
    size = {tag: nbytes for _, tag, nbytes in frees}
    tags = list(size)
    for k in range(len(tags) + 1):
        for held in combinations(tags, k):
            predicted = natural + sum(size[t] for t in held if t in early)
            assert true_peak(levels, frees, set(held)) <= predicted, (held, early)
    first_peak = levels.index(natural)
    before = {tag for pos, tag, _ in frees if pos < first_peak}
    assert before <= early
    assert true_peak(levels, frees, before) == natural + sum(size[t] for t in before)
