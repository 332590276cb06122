"""The IR and schedule files: exact round trips, stable fingerprints, and clear errors on bad input."""

import copy
import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solver import FormatError, OpGraph, Schedule, store_all_schedule
from toy_graphs import chain


def test_graph_json_round_trip_is_exact(tmp_path):
    g = chain((100, 200, 300), internal=5)
    path = tmp_path / "g.json"
    g.save(path)
    g2 = OpGraph.load(path)
    assert g2 == g and g2.to_dict() == g.to_dict() and g2.fingerprint == g.fingerprint


def test_schedule_json_round_trip_is_exact(tmp_path):
    s = store_all_schedule(chain())
    path = tmp_path / "s.json"
    s.save(path)
    assert Schedule.load(path) == s


def test_fingerprint_stable_and_sensitive_to_batch_not_costs():
    g = chain()
    assert g.fingerprint == chain().fingerprint
    assert dataclasses.replace(g, batch=2).fingerprint != g.fingerprint
    cheaper = chain(fwd=0.5, bwd=0.1)
    assert cheaper.fingerprint == g.fingerprint  # costs are not structure


def test_other_schema_version_is_refused(tmp_path):
    d = chain().to_dict()
    d["schema_version"] = 99
    path = tmp_path / "g.json"
    path.write_text(json.dumps(d))
    with pytest.raises(FormatError, match="schema_version: expected 1, got 99; re-profile"):
        OpGraph.load(path)


def test_truncated_file_is_refused(tmp_path):
    path = tmp_path / "g.json"
    path.write_text(json.dumps(chain().to_dict())[:200])
    with pytest.raises(FormatError, match="not valid JSON \\(truncated or corrupted\\?\\)"):
        OpGraph.load(path)


def test_save_is_atomic_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "s.json"
    s = store_all_schedule(chain())
    s.save(path)
    before = path.read_text()

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr("os.replace", boom)
    with pytest.raises(OSError):
        dataclasses.replace(s, mode="other").save(path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]


# -- fuzzing: truncated, mutated and wrong-typed documents raise FormatError naming the field --
GRAPH = chain((100, 200, 300), internal=5).to_dict()
SCHEDULE = store_all_schedule(chain((100, 200, 300), internal=5)).to_dict()
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**12), st.floats(allow_nan=True),
                 st.text(max_size=5), st.lists(st.integers(-2, 5), max_size=3),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


def _paths(doc, prefix=()):
    """All paths to leaves and containers of a JSON document."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


def _mutate(doc, path, new, delete):
    doc = copy.deepcopy(doc)
    if not path:
        return new
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return doc


def _check(loader, doc):
    try:
        loader(doc)
    except FormatError as e:
        # The message names a field or says what the document is.
        assert any(w in str(e) for w in ("graph", "schedule", "values", "ops", "impls", "stages",
                                          "outputs", "backward_order", "stage_grad_bytes", "."))
    # Loading a valid mutation is fine too: only FormatError may escape.


@pytest.mark.parametrize("doc,loader", [(GRAPH, OpGraph.from_dict),
                                        (SCHEDULE, Schedule.from_dict)], ids=["graph", "schedule"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_documents_raise_only_format_error(doc, loader, data):
    paths = list(_paths(doc))
    path = data.draw(st.sampled_from(paths))
    delete = bool(path) and data.draw(st.booleans())
    _check(loader, _mutate(doc, path, data.draw(JUNK), delete))


@pytest.mark.parametrize("doc,loader", [(GRAPH, OpGraph.from_dict),
                                        (SCHEDULE, Schedule.from_dict)], ids=["graph", "schedule"])
@settings(max_examples=200, deadline=None)
@given(cut=st.integers(min_value=0, max_value=10**6))
def test_truncated_documents_raise_only_format_error(tmp_path_factory, doc, loader, cut):
    text = json.dumps(doc)
    text = text[: cut % len(text)]
    path = tmp_path_factory.mktemp("t") / "doc.json"
    path.write_text(text)
    load = OpGraph.load if loader == OpGraph.from_dict else Schedule.load
    with pytest.raises(FormatError):
        load(path)


def test_wrong_type_names_the_field():
    d = copy.deepcopy(GRAPH)
    d["ops"][1]["impls"][0]["fwd_time"] = "fast"
    with pytest.raises(FormatError, match=r"ops\[1\].impls\[0\].fwd_time: expected a non-negative"):
        OpGraph.from_dict(d)
    s = copy.deepcopy(SCHEDULE)
    s["stages"][0]["recompute"] = [1, "x"]
    with pytest.raises(FormatError, match=r"schedule.stages\[0\].recompute\[1\]"):
        Schedule.from_dict(s)


def test_recompute_times_round_trip_and_do_not_change_the_fingerprint(tmp_path):
    g = chain((100, 200, 300))
    timed = dataclasses.replace(g, ops=tuple(
        dataclasses.replace(op, impls=tuple(dataclasses.replace(im, recompute_time=0.25 * (k + 1))
                                            for im in op.impls))
        for k, op in enumerate(g.ops)))
    path = tmp_path / "g.json"
    timed.save(path)
    back = OpGraph.load(path)
    assert back == timed and [op.impls[0].rerun_time for op in back.ops] == [0.25, 0.5, 0.75]
    assert back.fingerprint == g.fingerprint
    assert "recompute_time" not in g.to_dict()["ops"][0]["impls"][0]  # untimed graphs as before
    d = timed.to_dict()
    d["ops"][0]["impls"][0]["recompute_time"] = -1
    with pytest.raises(FormatError, match=r"recompute_time: expected a non-negative"):
        OpGraph.from_dict(d)


def test_without_impl_leaves_out_that_impl_only():
    from solver_cases import GraphBuilder
    b = GraphBuilder("impls")
    x = b.input("x", 8)
    a = b.op("a", [x], 8, impls=[dict(name="default", saved=("in0",)),
                                 dict(name="keep_me", saved=()),
                                 dict(name="drop_me", saved=())])
    b.op("b", [a], 1, impls=[dict(name="default", saved=("in0",)),
                             dict(name="drop_me", saved=())])
    g = b.build(outputs=[len(b.values) - 1])
    h = g.without_impl("drop_me")
    assert [[im.name for im in op.impls] for op in h.ops] == [["default", "keep_me"], ["default"]]
    assert [[im.name for im in op.impls] for op in g.ops][1] == ["default", "drop_me"]  # unchanged
    assert h.fingerprint != g.fingerprint and h.without_impl("absent") == h
