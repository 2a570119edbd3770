"""Shared fixtures and markers of the suite (markers: pytest.ini).

- ``gpu`` tests are skipped, with the reason, where CUDA is not available.
- tests that start processes (``dist_utils.run_torchrun``) must carry ``multiprocess`` (checked).
- ``broken_attention_backends``: backends wrong on purpose, for tests that must be able to fail.
- ``cpu_dist``: one gloo process with megatron-core's parallel state alone.
- ``cpu_megatron``: one gloo process with megatron-core's parallel state (TP = PP = 1), the
  compatibility patches and CPU mode, for a test module.
- On a machine with CUDA, every test not marked ``gpu`` runs in ``cpu_mode(force=True)``
  (``torch.cuda.is_available()`` reads False, as on CI): the CPU suite is the same test on every
  machine, and the GPU's share is the ``gpu`` tests. Subprocesses get ``CUDA_VISIBLE_DEVICES=""``
  (``dist_utils.cpu_env``).

The fast tier for development: ``python -m pytest -q tests -m "not slow and not multiprocess"``.
"""

import dist_utils
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _cpu_unless_gpu(request):
    """Tests not marked ``gpu`` run on the CPU on a GPU machine too (module-scoped fixtures that build
    models enter CPU mode themselves: ``cpu_megatron``, ``cpu_dist``)."""
    if not _CUDA or request.node.get_closest_marker("gpu"):
        yield
        return
    from megatron_tree.runtime import cpu_mode

    with cpu_mode(force=True):
        yield


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

    with cpu_mode(force=True), apply_compat_patches():  # CPU first: the patches look for CUDA / TE
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
