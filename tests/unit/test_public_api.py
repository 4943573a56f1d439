"""The public surface of ``reffsdp`` mirrors ``torch.distributed.fsdp`` (SPEC 1.1-1.3).

torch's own objects are the reference here: signatures and dataclass fields are compared
against them directly. Only tests use ``torch.distributed.fsdp`` (here, and as the
benchmark's reference in ``tests/benchmarks/torch_reference.py``); a test below checks the
package, its testing helpers and its benchmark never import it.

reffsdp offers the names later torch releases added to the per-parameter API on every
supported torch (``ADDED_AFTER_2_11``: ``DataParallelMeshDims`` in 2.12, the 2.15 additions).
Where the installed torch has a name it is compared like all others; on an older torch,
which has nothing to compare it with, it is left out of the comparison (and the 2.15 methods
are checked against the signatures 2.15 gives them).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import reffsdp
from reffsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from reffsdp.core.compat import TORCH_VERSION
from reffsdp.testing.fake_pg import fake_process_group

ROOT = pathlib.Path(__file__).resolve().parents[2]

FSDP2_NAMES = [
    "fully_shard",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "DataParallelMeshDims",
    "GradientReductionHandle",
]
POLICIES = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims"]

# What torch releases after 2.11 added to the per-parameter API, by release; reffsdp has
# all of it on every supported torch.
ADDED_AFTER_2_11 = {
    (2, 12): {
        "names": {"DataParallelMeshDims"},
        "arguments": {"fully_shard": {"dp_mesh_dims"}},
    },
    (2, 15): {
        "names": {"GradientReductionHandle"},
        "fields": {"MixedPrecisionPolicy": {"param_dtype_override_fn"}},
    },
}
# name -> (parameter name, kind, default) after self, as torch 2.15 declares them
METHODS_ADDED_IN_2_15 = {
    "set_keep_unsharded_storage": [
        ("keep", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
        ("recurse", inspect.Parameter.KEYWORD_ONLY, True),
    ],
    "set_manual_backward_finalization": [
        ("enabled", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
    ],
    "finalize_backward": [("async_op", inspect.Parameter.KEYWORD_ONLY, False)],
}
TORCH_HAS_2_15_API = TORCH_VERSION >= (2, 15)


def _torch_lacks(kind: str, owner: str | None = None) -> set[str]:
    """What the installed torch lacks of ``ADDED_AFTER_2_11[release][kind]`` (of
    ``owner``'s entry, for fields and arguments)."""
    lacking: set[str] = set()
    for release, added in ADDED_AFTER_2_11.items():
        if TORCH_VERSION < release:
            entry = added.get(kind, {})
            lacking |= entry.get(owner, set()) if owner is not None else entry
    return lacking


def _names_torch_lacks() -> set[str]:
    return _torch_lacks("names")


def _fields_torch_lacks(cls_name: str) -> set[str]:
    return _torch_lacks("fields", cls_name)


# -- names ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FSDP2_NAMES)
def test_fsdp2_name_is_exported_from_the_package(name):
    assert name in reffsdp.__all__
    assert getattr(reffsdp, name).__module__ == "reffsdp"


def test_all_lists_only_torch_names():
    """Every exported name is one ``torch.distributed.fsdp`` exports (or FlatParameter)."""
    allowed = {*torch_fsdp.__all__, "FlatParameter", *_names_torch_lacks()}
    assert set(reffsdp.__all__) <= allowed
    for name in reffsdp.__all__:
        assert hasattr(reffsdp, name), name


# -- signatures ----------------------------------------------------------------------------


def _comparable_default(default):
    """Defaults compared by value; dataclass instances by class name and the fields the
    installed torch's class has."""
    if dataclasses.is_dataclass(default) and not isinstance(default, type):
        name = type(default).__name__
        skip = _fields_torch_lacks(name)
        fields = [f.name for f in dataclasses.fields(default) if f.name not in skip]
        return name, tuple(getattr(default, field) for field in fields)
    return default


def _signature(fn, skip: set[str] = frozenset()) -> list[tuple]:
    return [
        (p.name, p.kind, _comparable_default(p.default))
        for p in inspect.signature(fn).parameters.values()
        if p.name not in skip
    ]


@pytest.mark.parametrize("name", ["fully_shard", "register_fsdp_forward_method", "share_comm_ctx"])
def test_function_signature_matches_torch(name):
    ours = _signature(getattr(reffsdp, name), skip=_torch_lacks("arguments", name))
    assert ours == _signature(getattr(torch_fsdp, name))


def _torch_fsdp_module_methods() -> list[str]:
    names = [
        name
        for name, value in vars(torch_fsdp.FSDPModule).items()
        if callable(value) and (not name.startswith("_") or name in ("_get_fsdp_state",))
    ]
    return sorted({*names, "_set_unshard_async_op"} & set(dir(torch_fsdp.FSDPModule)))


@pytest.mark.parametrize("name", _torch_fsdp_module_methods())
def test_fsdp_module_method_signature_matches_torch(name):
    ours = getattr(FSDPModule, name, None)
    if ours is None:
        pytest.xfail(f"FSDPModule.{name} is not implemented yet")
    assert _signature(ours) == _signature(getattr(torch_fsdp.FSDPModule, name))


@pytest.mark.parametrize("name", sorted(METHODS_ADDED_IN_2_15))
def test_methods_added_in_2_15_have_their_2_15_signatures(name):
    """On every torch; from 2.15 the test above also compares them with torch's."""
    expected = [("self", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty)]
    expected += METHODS_ADDED_IN_2_15[name]
    assert _signature(getattr(FSDPModule, name)) == expected
    if TORCH_HAS_2_15_API:
        assert _signature(getattr(torch_fsdp.FSDPModule, name)) == expected


@pytest.mark.parametrize("name", ["UnshardHandle", "GradientReductionHandle"])
def test_handle_wait_signature_matches_torch(name):
    handle = getattr(reffsdp, name)
    assert _signature(handle.wait) == [
        ("self", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty)
    ]
    if name in _names_torch_lacks():
        return
    assert _signature(handle.wait) == _signature(getattr(torch_fsdp, name).wait)
    assert handle().wait() is None


# -- policies ------------------------------------------------------------------------------


def _fields(cls, skip: set[str] = frozenset()) -> list[tuple]:
    return [
        (f.name, f.default, f.default_factory, f.kw_only)
        for f in dataclasses.fields(cls)
        if f.name not in skip
    ]


@pytest.mark.parametrize("name", POLICIES)
def test_policy_fields_and_defaults_match_torch(name):
    if name in _names_torch_lacks():
        pytest.skip(f"torch {torch.__version__} has no {name} to compare with")
    ours, theirs = getattr(reffsdp, name), getattr(torch_fsdp, name)
    assert dataclasses.is_dataclass(ours)
    assert _fields(ours, skip=_fields_torch_lacks(name)) == _fields(theirs)
    assert ours.__dataclass_params__.frozen == theirs.__dataclass_params__.frozen


def test_policy_hierarchy():
    assert issubclass(reffsdp.CPUOffloadPolicy, reffsdp.OffloadPolicy)
    assert reffsdp.CPUOffloadPolicy().pin_memory is True


def test_param_dtype_override_fn_is_a_keyword_only_field_added_in_2_15():
    (field,) = [f for f in dataclasses.fields(MixedPrecisionPolicy) if f.name.endswith("_fn")]
    assert (field.name, field.default, field.kw_only) == ("param_dtype_override_fn", None, True)
    with pytest.raises(TypeError):
        MixedPrecisionPolicy(None, None, None, True, lambda p: None)  # keyword only


def test_mixed_precision_policy_is_frozen_and_hashable():
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.param_dtype = torch.float32
    assert hash(policy) == hash(MixedPrecisionPolicy(param_dtype=torch.bfloat16))


def test_data_parallel_mesh_dims():
    dims = reffsdp.DataParallelMeshDims(shard=("a", "b"), replicate="r")
    assert dims.shard_names == ("a", "b")
    assert dims.replicate_names == ("r",)
    assert reffsdp.DataParallelMeshDims(shard="s").replicate_names == ()
    with pytest.raises(ValueError):
        reffsdp.DataParallelMeshDims()


# -- what fully_shard does to a module -----------------------------------------------------


@pytest.fixture
def mesh():
    with fake_process_group(2, rank=0):
        yield init_device_mesh("cpu", (2,))


def test_class_swap(mesh):
    lin = nn.Linear(4, 4)
    assert fully_shard(lin, mesh=mesh) is lin
    assert type(lin).__name__ == "FSDPLinear"
    assert isinstance(lin, nn.Linear)
    assert isinstance(lin, FSDPModule)
    assert isinstance(lin, torch_fsdp.FSDPModule) is False  # ours, not torch's
    other = fully_shard(nn.Linear(2, 2), mesh=mesh)
    assert type(other) is type(lin)  # one cached class per original class
    assert type(lin).__bases__ == (FSDPModule, nn.Linear)


def test_slicing_a_sharded_sequential_gives_a_plain_one(mesh):
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    fully_shard(seq[0], mesh=mesh)
    fully_shard(seq, mesh=mesh)
    assert type(seq).__name__ == "FSDPSequential"
    tail = seq[1:]
    assert type(tail) is nn.Sequential
    head = seq[:1]
    assert type(head) is nn.Sequential
    assert head[0] is seq[0]  # the children are the sharded modules themselves


def test_list_form_returns_the_list(mesh):
    modules = [nn.Linear(4, 4), nn.Linear(4, 4)]
    assert fully_shard(modules, mesh=mesh) is modules
    assert all(isinstance(m, FSDPModule) for m in modules)
    assert fully_shard.state(modules[0]) is fully_shard.state(modules[1])


def test_state_accessor(mesh):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert fully_shard.state(model) is model._get_fsdp_state()
    assert fully_shard.state(model[0]) is model[0]._get_fsdp_state()
    assert fully_shard.state(model) is not fully_shard.state(model[0])
    assert fully_shard.state(model[1]) is None
    assert fully_shard.state(nn.Linear(1, 1)) is None


def test_managed_module_markers(mesh):
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 4))
    plain = nn.Linear(4, 4)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        assert module._is_fsdp_managed_module is True
        assert module._fsdp_use_orig_params is True
    assert not hasattr(plain, "_is_fsdp_managed_module")


def test_dtype_and_device_conversions_after_fully_shard(mesh):
    """``.double()``/``to_empty()`` go through ``nn.Module._apply``, which swaps DTensor
    parameters in place; nothing reffsdp keeps may block that (e.g. a weak reference)."""
    lin = fully_shard(nn.Linear(4, 4), mesh=mesh)
    weight = lin.weight
    lin.double()
    assert lin.weight is weight and weight.dtype == torch.float64
    assert weight.to_local().dtype == torch.float64
    lin.to_empty(device="cpu")
    assert isinstance(lin.weight, DTensor)
    assert lin.weight.placements == (Shard(0),)


def test_signature_of_methods_on_an_instance_hides_self(mesh):
    lin = fully_shard(nn.Linear(4, 4), mesh=mesh)
    assert list(inspect.signature(lin.set_requires_gradient_sync).parameters) == [
        "requires_gradient_sync",
        "recurse",
    ]


# -- clean room ----------------------------------------------------------------------------

FORBIDDEN = ("torch.distributed.fsdp", "torch.testing._internal")


def _imported_modules(tree: ast.AST) -> list[str]:
    """Modules a file imports: import statements and literal ``import_module`` calls."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            fname = getattr(func, "attr", None) or getattr(func, "id", None)
            first = node.args[0]
            if fname in ("import_module", "__import__") and isinstance(first, ast.Constant):
                names.append(str(first.value))
    return names


BENCH = ROOT / "reffsdp" / "bench"


def _package_sources() -> list[pathlib.Path]:
    return sorted([*(ROOT / "reffsdp").rglob("*.py"), *(ROOT / "testing").rglob("*.py")])


# ``python -m reffsdp.swap`` imports torch's FSDP modules only to rebind their public names
# to reffsdp's ([Note: the swap] there); these and nothing else of them.
SWAP = ROOT / "reffsdp" / "swap.py"
SWAP_MAY_IMPORT = {
    "torch.distributed.fsdp",
    "torch.distributed._composable.fsdp",
    "torch.distributed.fsdp.api",
    "torch.distributed.fsdp.fully_sharded_data_parallel",
    "torch.distributed.fsdp.sharded_grad_scaler",
    "torch.distributed.fsdp.wrap",
}


# The parity suite checks torch's FSDP as an implementation under test (``--impl torch``):
# this one module presents it, importing torch.distributed.fsdp and nothing else of it.
TORCH_IMPL = ROOT / "testing" / "impls" / "torch_fsdp.py"
TORCH_IMPL_MAY_IMPORT = {"torch.distributed.fsdp"}


def _may_import(path: pathlib.Path, name: str) -> bool:
    if path == SWAP:
        return name in SWAP_MAY_IMPORT
    return path == TORCH_IMPL and name in TORCH_IMPL_MAY_IMPORT


def test_sources_never_import_torch_fsdp_or_torch_internal_testing():
    """No file of the package, its testing helpers or its benchmark imports either (the swap
    and the parity suite's presentation of torch's FSDP aside, below); torch's
    implementations the benchmark measures against are built under ``tests/``."""
    sources = _package_sources()
    assert len(sources) > 10
    assert BENCH / "impls.py" in sources and SWAP in sources and TORCH_IMPL in sources
    offenders = []
    for path in sources:
        for name in _imported_modules(ast.parse(path.read_text(), filename=str(path))):
            if name.startswith(FORBIDDEN) and not _may_import(path, name):
                offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert offenders == []
    torch_impl_imports = set(_imported_modules(ast.parse(TORCH_IMPL.read_text())))
    assert torch_impl_imports & TORCH_IMPL_MAY_IMPORT == TORCH_IMPL_MAY_IMPORT


def test_only_the_implementation_loader_reaches_torchs_fsdp_and_reffsdp_never_does():
    """``testing/impls/torch_fsdp.py`` is imported by the loader of ``--impl`` alone (which
    imports it only when torch is named); nothing under ``reffsdp/`` imports the testing
    package's implementations at all."""
    importers = []
    for path in _package_sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("torch_fsdp"):
                importers.append(path)
        if path.is_relative_to(ROOT / "reffsdp"):
            assert not [n for n in _imported_modules(tree) if "testing.impls" in n], path
    assert importers == [ROOT / "testing" / "impls" / "__init__.py"]


def test_the_swap_only_rebinds_torchs_names():
    """The swap reads nothing of torch's FSDP modules: it only assigns to them (``setattr``
    over its table of module pairs), and nothing else of reffsdp imports the swap."""
    tree = ast.parse(SWAP.read_text())
    torch_attributes = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and ast.unparse(node).startswith("torch.distributed.")
    ]
    used = {ast.unparse(node) for node in torch_attributes}
    prefixes = {name.rsplit(".", 1)[0] for name in SWAP_MAY_IMPORT}  # parts of a longer name
    assert used <= SWAP_MAY_IMPORT | prefixes
    assert used & SWAP_MAY_IMPORT == SWAP_MAY_IMPORT
    for path in _package_sources():
        if path != SWAP:
            assert "reffsdp.swap" not in _imported_modules(ast.parse(path.read_text())), path


def test_the_benchmark_finds_torch_builders_in_the_tests_from_the_repository_root():
    """From the repository root, ``reffsdp.bench`` loads both of torch's implementations
    from the reference module under ``tests/``, and they build torch's FSDP, not ours."""
    script = textwrap.dedent(
        """
        import importlib, sys
        import torch, torch.nn as nn
        from torch.distributed.device_mesh import init_device_mesh
        from reffsdp.bench import impls
        from reffsdp.bench.models import Workload
        from reffsdp.testing.fake_pg import fake_process_group

        assert impls.REFERENCE_MODULE.startswith("tests."), impls.REFERENCE_MODULE
        module = importlib.import_module(impls.REFERENCE_MODULE)
        assert module.__file__.startswith(sys.argv[1]), module.__file__
        assert set(module.BUILDERS) == set(impls.REFERENCE_IMPLS)
        assert set(impls.REFERENCE_IMPLS) == {"torch_fully_shard", "torch_fsdp"}
        options = impls.Options(Workload("mlp", "tiny"), torch.device("cpu"), "fake", False, None)
        with fake_process_group(2, rank=0):
            init_device_mesh("cpu", (2,))
            base = options.workload.build(options.device)
            for name in impls.REFERENCE_IMPLS:
                assert impls.skip_reason(name, options) is None, name
                model = impls.build(name, base, options)
                assert type(model).__module__.startswith("torch.distributed.fsdp"), type(model)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(ROOT)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_scanner_sees_forbidden_imports():
    code = textwrap.dedent(
        """
        import torch.distributed.fsdp._fully_shard as f
        from torch.distributed import fsdp
        from torch.testing._internal.common_fsdp import FSDPTest
        importlib.import_module("torch.distributed.fsdp")
        """
    )
    names = _imported_modules(ast.parse(code))
    assert sum(name.startswith(FORBIDDEN) for name in names) >= 4


def test_importing_reffsdp_loads_no_torch_fsdp_and_warns_nothing():
    """In a fresh interpreter: importing reffsdp, its testing helpers and its benchmarks
    neither imports ``torch.distributed.fsdp`` nor emits a FutureWarning/DeprecationWarning."""
    modules = sorted(
        f"reffsdp.{package}.{path.stem}"
        for package, folder in (("testing", ROOT / "testing"), ("bench", BENCH))
        for path in folder.glob("*.py")
        if path.stem not in ("__init__", "__main__")
    )
    assert "reffsdp.bench.impls" in modules
    script = textwrap.dedent(
        f"""
        import sys, warnings
        import torch, torch.distributed
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import reffsdp, reffsdp.testing, reffsdp.bench
            for name in {modules!r}:
                __import__(name)
        bad = [f"{{w.category.__name__}}: {{w.message}}" for w in caught
               if issubclass(w.category, (FutureWarning, DeprecationWarning))]
        assert not bad, bad
        assert "torch.distributed.fsdp" not in sys.modules
        assert "tests.benchmarks.torch_reference" not in sys.modules
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_original_parameter_identity_is_a_stamped_uid_not_id():
    # ``id()`` of a replaced parameter can be reused by a later one; the uid cannot.
    from reffsdp.per_param.sharded_param import _original_uid

    first = torch.nn.Parameter(torch.zeros(2))
    uid = _original_uid(first)
    assert _original_uid(first) == uid
    assert all(_original_uid(torch.nn.Parameter(torch.zeros(2))) != uid for _ in range(50))


def test_import_reffsdp_makes_its_submodules_attributes_like_torch():
    """After a bare ``import``, ``<package>.wrap`` and friends are there, as in torch's."""
    script = textwrap.dedent(
        """
        import sys
        import reffsdp
        import torch.distributed.fsdp as torch_fsdp

        for name in ("wrap", "api", "fully_sharded_data_parallel"):
            assert hasattr(torch_fsdp, name), name
            assert hasattr(reffsdp, name), name
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_names_torch_tests_import_from_the_wrapper_module():
    """torch's FSDP tests import these private names; reffsdp has them, meaning the same."""
    import torch.distributed.fsdp.fully_sharded_data_parallel as torch_module

    from reffsdp import fully_sharded_data_parallel as module

    assert module.FLAT_PARAM == torch_module.FLAT_PARAM
    with fake_process_group(2, rank=0):
        wrapped = module.FullyShardedDataParallel(nn.Linear(2, 2))
    assert isinstance(getattr(wrapped.module, module.FLAT_PARAM), reffsdp.FlatParameter)
