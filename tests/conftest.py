"""Shared fixtures and markers of the suite (markers: pytest.ini).

- On a GPU host the suite runs in two passes (``two_pass``): the CPU suite with CUDA and Transformer
  Engine hidden, as on CI, then the ``gpu`` tests in a second pytest with CUDA visible; one command, one exit code.
- ``gpu`` tests are skipped, with the reason, where CUDA is not available.
- each failure's test and error line is printed as it fails (``instant_failures``), not only at the end.
- tests that start processes (``dist_utils.run_torchrun``) must carry ``multiprocess`` (checked); their jobs run
  in forks of one server process that imported megatron-core once (``tests/fork_server.py``), started when the
  selection holds a ``multiprocess`` or ``slow`` test.
- ``broken_attention_backends``: backends wrong on purpose, for tests that must be able to fail.
- ``cpu_dist``: one gloo process with megatron-core's parallel state alone.
- ``cpu_megatron``: one gloo process with megatron-core's parallel state (TP = PP = 1), the
  compatibility patches and CPU mode (a no-op where CUDA is available), for a test module.

The fast tier for development: ``python -m pytest -q tests -m "not slow and not multiprocess"``.
"""

import dist_utils
import pytest
import two_pass

GPU_PASS = two_pass.hide_cuda_for_pass_one()  # before torch touches CUDA in this process
two_pass.hide_transformer_engine()  # in the CPU pass, as on CI: before anything imports TE

import numpy as np  # noqa: E402
import torch  # noqa: E402

pytest_plugins = ["instant_failures"]  # a failure's test and error line as soon as it fails


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    reason = "needs a CUDA GPU" if GPU_PASS is None else "runs in the GPU pass, after this one (CUDA visible)"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Start the fork server of the multi-process and subprocess jobs (``dist_utils``) now, so its imports run
    beside the first tests, when the selection holds such a job (they are all ``multiprocess`` or ``slow``)."""
    if not session.config.option.collectonly and any(
        item.get_closest_marker("multiprocess") or item.get_closest_marker("slow") for item in session.items
    ):
        dist_utils.FORK_SERVER.start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtestloop(session):
    yield
    if GPU_PASS is not None and not session.config.option.collectonly and not session.shouldstop:
        rc = two_pass.run_gpu_pass(session.config, GPU_PASS)
        session.config.stash[_GPU_PASS_RC] = rc
        if rc not in (0, 5):  # 5: the selection holds no gpu test
            session.testsfailed += 1


_GPU_PASS_RC = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    rc = config.stash.get(_GPU_PASS_RC, None)
    if rc is not None:
        outcome = {0: "passed", 5: "no gpu test selected"}.get(rc, f"FAILED (exit code {rc}, its output above)")
        terminalreporter.write_line(f"GPU pass (the gpu tests, CUDA visible): {outcome}")


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same global RNG state (torch, CUDA included, and numpy's legacy one), whatever ran
    before it: a test drawing from them sees the same numbers alone, in the whole suite, or in the GPU pass."""
    torch.manual_seed(0)
    np.random.seed(0)


@pytest.fixture(autouse=True)
def _markers_for_dist_utils(request):
    """Tell :func:`dist_utils.run_torchrun` the running test's markers (it refuses to run without ``multiprocess``)."""
    dist_utils.CURRENT_MARKERS = {m.name for m in request.node.iter_markers()}
    yield
    dist_utils.CURRENT_MARKERS = None


@pytest.fixture(scope="module")
def cpu_dist():
    """One gloo process with megatron-core's parallel state, without CPU mode or the compatibility patches
    (for tests of those); an existing process group is kept."""
    import torch.distributed as dist

    from megatron_tree.runtime import destroy_distributed, init_cpu_distributed

    created = not dist.is_initialized()
    init_cpu_distributed()
    yield
    if created:
        destroy_distributed()


@pytest.fixture(scope="module")
def cpu_megatron():
    from megatron_tree.compat import apply_compat_patches
    from megatron_tree.runtime import cpu_mode, destroy_distributed, init_cpu_distributed

    with apply_compat_patches(), cpu_mode():
        init_cpu_distributed(tp=1)
        yield
        destroy_distributed()


class _WrongQueryGrad(torch.autograd.Function):
    """Identity forward; the backward scales dQ by 1.3 (the kind of bug FA4 4.0.0b36 has at head dims 72 - 112)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.3


@pytest.fixture
def broken_attention_backends():
    """Two registered tree attention backends, wrong where a forward-only check cannot see it
    (``"test_wrong_dq"``: dQ x 1.3) or in the mask (``"test_wrong_mask"``: one visible pair too many);
    yields their names, unregisters them after the test."""
    from megatron_tree.attention import dense, dispatch

    def wrong_dq(q, k, v, prepared, *, scale, dropout_p):
        return dense.attend(_WrongQueryGrad.apply(q), k, v, prepared, scale=scale, dropout_p=dropout_p)

    def one_pair_too_many(subtree_end, query_slots=None):
        mask = dense.prepare(subtree_end, query_slots).clone()
        mask[..., -1, 0] = True  # the last query sees slot 0 (a root it does not descend from)
        return mask

    backends = [
        dispatch.TreeAttentionBackend("test_wrong_dq", dense.prepare, wrong_dq, dense.refusal),
        dispatch.TreeAttentionBackend("test_wrong_mask", one_pair_too_many, dense.attend, dense.refusal),
    ]
    for backend in backends:
        dispatch.register_tree_attention_backend(backend)
    yield [b.name for b in backends]
    for backend in backends:
        del dispatch._BACKENDS[backend.name]
