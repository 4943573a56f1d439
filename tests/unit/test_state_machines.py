"""The three state machines of [Note: state machines] in ``reffsdp/core/states.py``.

Each table is checked move by move; real ``fully_shard`` modules (rank 1 of a fake world)
drive every legal move of a state's training state and of a group's sharding through the
one method that makes it; and the source is read to prove that nothing else assigns
those states, or the communication context.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from reffsdp import (
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from reffsdp.core.states import (
    GROUP_SHARDING,
    GROUP_TRAINING,
    STATE_TRAINING,
    ShardedState,
    TrainingState,
    check_transition,
)

TABLES = {
    "state training": (STATE_TRAINING, TrainingState),
    "group training": (GROUP_TRAINING, TrainingState),
    "group sharding": (GROUP_SHARDING, ShardedState),
}
PACKAGE = Path(__file__).resolve().parents[2] / "reffsdp"


def _legal(table) -> set[tuple]:
    return {(start, end) for start, ends in table.items() for end in ends}


@pytest.mark.parametrize("machine", TABLES)
def test_every_move_is_checked_against_its_table(machine):
    table, states = TABLES[machine]
    assert set(table) == set(states), "every state has a row"
    for start, end in itertools.product(states, states):
        if end in table[start]:
            check_transition(table, start, end, owner="block on rank 1")
            continue
        message = f"block on rank 1: cannot go from {start.name} to {end.name}"
        with pytest.raises(RuntimeError, match=message):
            check_transition(table, start, end, owner="block on rank 1")


def _record(obj, method: str, read: str, moves: list[tuple]) -> None:
    """Record every move ``obj`` makes through its transition method ``method``."""
    original = getattr(obj, method)

    def recording(new):
        moves.append((getattr(obj, read), new))
        original(new)

    setattr(obj, method, recording)


class _TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        return y, 2 * y

    def twice(self, x: torch.Tensor) -> torch.Tensor:
        """A forward method that calls ``forward``: the state's forward starts again."""
        return sum(self(x))


def test_a_state_makes_every_legal_move(mesh):
    model = _TwoOutputs()
    fully_shard(model, mesh=mesh)
    register_fsdp_forward_method(model, "twice")
    state = model._get_fsdp_state()
    moves: list[tuple] = []
    _record(state, "_to_training_state", "training_state", moves)
    model.twice(torch.randn(2, 4))  # IDLE -> FORWARD -> FORWARD -> IDLE
    a, b = model(torch.randn(2, 4))
    (a.sum() + b.sum()).backward()  # two outputs: PRE_BACKWARD twice, then IDLE
    model.reset_iter_state()  # IDLE -> IDLE
    assert set(moves) == _legal(STATE_TRAINING)
    assert state.training_state is TrainingState.IDLE


def test_a_state_refuses_illegal_moves(mesh):
    model = _TwoOutputs()
    fully_shard(model, mesh=mesh)
    state = model._get_fsdp_state()
    state._to_training_state(TrainingState.FORWARD)
    with pytest.raises(RuntimeError, match="cannot go from FORWARD to PRE_BACKWARD"):
        state._to_training_state(TrainingState.PRE_BACKWARD)
    state._to_training_state(TrainingState.IDLE)
    state._to_training_state(TrainingState.PRE_BACKWARD)
    with pytest.raises(RuntimeError, match=r"\(_TwoOutputs\): cannot go from PRE_BACKWARD to FO"):
        state._to_training_state(TrainingState.FORWARD)
    state._leave_forward()  # a forward run again in backward leaves the state alone
    assert state.training_state is TrainingState.PRE_BACKWARD
    with pytest.raises(RuntimeError, match="cannot go from PRE_BACKWARD to POST_BACKWARD"):
        state._to_training_state(TrainingState.POST_BACKWARD)


def test_a_group_makes_every_legal_sharding_move(mesh):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0], mesh=mesh, reshard_after_forward=2)  # SHARDED_POST_FORWARD
    fully_shard(model[1], mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    post_forward, lower = (model[i]._get_fsdp_state().group for i in (0, 1))
    moves: list[tuple] = []
    for group in (post_forward, lower):
        _record(group, "_to_sharded_state", "sharded_state", moves)
    model(torch.randn(2, 4)).sum().backward()  # SHARDED -> UNSHARDED -> SPF -> UNSHARDED
    model(torch.randn(2, 4))  # SHARDED_POST_FORWARD again ...
    model[0].reshard()  # ... and straight to SHARDED
    for group in (post_forward, lower):
        with group.unsharded_in_full_precision():  # SHARDED -> SUMMONED -> SHARDED
            assert group.sharded_state is ShardedState.SUMMONED
        group.unshard()
        group.wait_for_unshard()
        # UNSHARDED -> SUMMONED -> UNSHARDED: as it is (fp32), or with bf16 buffers set aside
        with group.unsharded_in_full_precision():
            assert group.sharded_state is ShardedState.SUMMONED
            assert group.members[0].unsharded_param.dtype is torch.float32
        assert group.sharded_state is ShardedState.UNSHARDED
        group.reshard()  # UNSHARDED -> SHARDED
    assert set(moves) == _legal(GROUP_SHARDING)


def test_a_group_refuses_illegal_sharding_moves(mesh):
    model = nn.Linear(4, 4)
    fully_shard(model, mesh=mesh)
    model(torch.randn(2, 4))  # lazy init
    model.reshard()
    group = model._get_fsdp_state().group
    with pytest.raises(RuntimeError, match="on rank 1: cannot go from SHARDED to SHARDED_POST_"):
        group._to_sharded_state(ShardedState.SHARDED_POST_FORWARD)
    with group.unsharded_in_full_precision():
        with pytest.raises(RuntimeError, match="cannot go from SUMMONED to SUMMONED"):
            with group.unsharded_in_full_precision():
                pass
        with pytest.raises(RuntimeError, match="cannot go from SUMMONED to SHARDED_POST_FORWARD"):
            group._to_sharded_state(ShardedState.SHARDED_POST_FORWARD)
    assert group.sharded_state is ShardedState.SHARDED


# -- one owner each ---------------------------------------------------------------------------

# Attribute -> (module, method) pairs allowed to assign it: the owner's transition method
# and its constructor; the communication context's binding and its one replacement.
OWNERS = {
    "training_state": set(),
    "_training_state": {
        ("core/driver.py", "__init__"),
        ("core/driver.py", "_to_training_state"),
        ("core/param_group.py", "__init__"),
        ("core/param_group.py", "_to_training_state"),
    },
    "sharded_state": set(),
    "_sharded_state": {
        ("core/param_group.py", "__init__"),
        ("core/param_group.py", "_to_sharded_state"),
    },
    "comm": {("core/driver.py", "share_comm_ctx")},
    "comm_ctx": {("core/param_group.py", "__init__"), ("core/param_group.py", "bind")},
    "ctx": {("core/driver.py", "use_root_context")},
    # The one flag of an asynchronous finalization, on the communication context.
    "async_finalization": {
        ("per_param/finalization.py", "finalize"),
        ("per_param/finalization.py", "wait"),
        ("per_param/state.py", "reset_iter_state"),
    },
}


class _Assignments(ast.NodeVisitor):
    """(module, innermost enclosing function, attribute) of every attribute assignment."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.function = "<module>"
        self.found: set[tuple[str, str, str]] = set()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        outer, self.function = self.function, node.name
        self.generic_visit(node)
        self.function = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def _targets(self, targets: list[ast.expr]) -> None:
        for target in targets:
            if isinstance(target, ast.Attribute):  # obj.attr = ... (not obj.attr.x = ...)
                self.found.add((self.module, self.function, target.attr))
            elif isinstance(target, (ast.Tuple, ast.List)):
                self._targets(target.elts)
            elif isinstance(target, ast.Starred):
                self._targets([target.value])

    def visit_Assign(self, node: ast.Assign) -> None:
        self._targets(node.targets)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._targets([node.target])
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._targets([node.target])
        self.generic_visit(node)


def _assignments() -> set[tuple[str, str, str]]:
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        visitor = _Assignments(path.relative_to(PACKAGE).as_posix())
        visitor.visit(ast.parse(path.read_text(encoding="utf-8")))
        found |= visitor.found
    return found


def test_each_state_and_the_comm_context_have_one_owner():
    strays = sorted(
        f"{module}:{function} assigns .{attr}"
        for module, function, attr in _assignments()
        if attr in OWNERS and (module, function) not in OWNERS[attr]
    )
    assert not strays


def test_only_the_driver_binds_groups_to_a_comm_context():
    callers = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "bind":  # ParamGroup.bind: no other bind in reffsdp
                    callers.add(path.relative_to(PACKAGE).as_posix())
    assert callers == {"core/driver.py"}


def test_groups_use_their_state_then_their_roots_comm_context(mesh):
    model, other = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 4)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    fully_shard(other, mesh=mesh)
    root, child = model._get_fsdp_state(), model[0]._get_fsdp_state()
    model[0].unshard()  # before any root: through its own state's context
    assert child.group.comm_ctx is child.comm_ctx is not root.comm_ctx
    model(torch.randn(2, 4))  # lazy init: every group under the root uses the root's
    assert child.ctx is root.ctx
    assert {id(g.comm_ctx) for g in root.groups_under_root()} == {id(root.comm_ctx)}
    share_comm_ctx([other, model])  # the one replacement
    shared = other._get_fsdp_state().comm_ctx
    assert root.comm_ctx is shared
    assert {id(g.comm_ctx) for g in root.groups_under_root()} == {id(shared)}


def test_sharing_refuses_a_context_an_async_finalization_holds(mesh):
    model, other = nn.Linear(4, 4), nn.Linear(4, 4)
    for module in (model, other):
        fully_shard(module, mesh=mesh)
    model.set_manual_backward_finalization(True)
    model(torch.randn(2, 4)).sum().backward()
    handle = model.finalize_backward(async_op=True)
    with pytest.raises(RuntimeError, match="asynchronous finalize_backward not yet waited"):
        share_comm_ctx([other, model])
    handle.wait()
    share_comm_ctx([other, model])
    assert model._get_fsdp_state().comm_ctx is other._get_fsdp_state().comm_ctx
