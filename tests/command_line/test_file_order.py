"""The order in which the suite's files go out to pytest-xdist's workers (harness/file_order.py):
the named builder of the shared fixture first, then the files that do not use it, then the other
files that use it; each file's tests together and in their own order."""

from dataclasses import dataclass, field

from harness.file_order import ordered


@dataclass
class FakeItem:
    nodeid: str
    fixturenames: list = field(default_factory=list)


def items_of(spec: dict[str, tuple[int, bool]]) -> list[FakeItem]:
    """spec: file -> (number of tests, uses the shared fixture), in collection order; one test of
    a file that uses it asks for it, the others do not (as test_sampling's powered tests)."""
    return [FakeItem(f"{name}::t{i}", ["tmp_path"] + (["trained_run"] if uses and i == n - 1 else []))
            for name, (n, uses) in spec.items() for i in range(n)]


def files(items) -> list[str]:
    out = []
    for item in items:
        name = item.nodeid.split("::")[0]
        if not out or out[-1] != name:
            out.append(name)
    return out


SPEC = {"a.py": (3, False), "eval.py": (2, True), "b.py": (5, False), "sampling.py": (4, True),
        "c.py": (3, False), "train.py": (1, True)}


def test_the_builder_goes_first_the_other_users_last():
    order = ordered(items_of(SPEC), "trained_run", builder="eval.py")
    # Written out from the rule: eval.py; then a, b, c by number of tests (5, 3, 3: ties as
    # collected); then sampling (4) and train (1).
    assert files(order) == ["eval.py", "b.py", "a.py", "c.py", "sampling.py", "train.py"]


def test_each_files_tests_stay_together_and_in_order_and_none_is_lost():
    items = items_of(SPEC)
    order = ordered(items, "trained_run", builder="eval.py")
    assert sorted(i.nodeid for i in order) == sorted(i.nodeid for i in items) and len(order) == len(items)
    for name in SPEC:
        mine = [i.nodeid for i in order if i.nodeid.startswith(name + "::")]
        assert mine == [f"{name}::t{k}" for k in range(SPEC[name][0])]
    assert len(files(order)) == len(SPEC)   # no file split in two runs


def test_without_the_named_builder_the_user_with_most_tests_builds():
    """A run of a few files (a tier, `pytest tests/eval/test_sampling.py ...`) may not collect it."""
    spec = {name: v for name, v in SPEC.items() if name != "eval.py"}
    assert files(ordered(items_of(spec), "trained_run", builder="eval.py")) == [
        "sampling.py", "b.py", "a.py", "c.py", "train.py"]
    # A builder that does not use the fixture is not moved.
    assert files(ordered(items_of(spec), "trained_run", builder="a.py"))[0] == "sampling.py"


def test_no_file_uses_the_fixture():
    spec = {"a.py": (1, False), "b.py": (2, False)}
    assert files(ordered(items_of(spec), "trained_run", builder="a.py")) == ["b.py", "a.py"]
