"""The scorer's CPU kernels: every kernel set this machine runs against a float64 reference, and the run-time
choice of kernel set (CPU detection, the KVP_KERNEL override)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from kvp_cpp import _core

KERNELS = _core.available_kernels()
ACTIVATIONS = ["relu", "silu", "gelu_tanh", "tanh"]
# Sizes around every vector width (4, 8, 16) and register tile (16, 64 outputs; 4 tokens), including remainders.
N_IN = [1, 7, 129, 131, 200]
N_OUT = [1, 3, 17, 32, 65, 100]
TOKENS = [0, 1, 5, 64]


def reference_activation(name: str, z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        if name == "relu":
            return np.maximum(z, 0.0)
        if name == "silu":
            return z / (1.0 + np.exp(-z))
        if name == "gelu_tanh":
            return 0.5 * z * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + 0.044715 * z**3)))
        if name == "tanh":
            return np.tanh(z)
    raise ValueError(name)


def assert_close(got: np.ndarray, ref: np.ndarray, context: str) -> None:
    """|got - ref| <= 1e-4 * max(1, |ref|) everywhere: relative for large values, absolute near zero."""
    assert got.dtype == np.float32 and got.shape == ref.shape, context
    err = np.abs(got.astype(np.float64) - ref)
    excess = err - 1e-4 * np.maximum(1.0, np.abs(ref))
    if excess.size and not (excess <= 0).all():
        worst = np.unravel_index(np.nanargmax(np.where(np.isnan(excess), np.inf, excess)), excess.shape)
        raise AssertionError(
            f"{context}: {int((~(excess <= 0)).sum())} of {excess.size} values off; "
            f"worst at {worst}: got {got[worst]!r}, expected {ref[worst]!r}"
        )


def random_layer(rng: np.random.Generator, n_tokens: int, n_in: int, n_out: int):
    x = (2.0 * rng.standard_normal((n_tokens, n_in))).astype(np.float32)
    w = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)
    b = rng.standard_normal(n_out).astype(np.float32)
    return x, w, b


# --- dense and dot against float64 ------------------------------------------------------------------------------


@pytest.mark.parametrize("n_in", N_IN)
@pytest.mark.parametrize("activation", [*ACTIVATIONS, None], ids=[*ACTIVATIONS, "affine"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_dense_matches_float64_reference(kernel: str, activation: str | None, n_in: int) -> None:
    rng = np.random.default_rng([n_in, ACTIVATIONS.index(activation) if activation else 9])
    for n_out in N_OUT:
        for n_tokens in TOKENS:
            x, w, b = random_layer(rng, n_tokens, n_in, n_out)
            y = _core.kernel_dense(kernel, x, w, b, activation or "relu", activation is not None)
            z = x.astype(np.float64) @ w.astype(np.float64).T + b.astype(np.float64)
            ref = reference_activation(activation, z) if activation else z
            assert_close(y, ref, f"{kernel} dense {activation} T={n_tokens} n_in={n_in} n_out={n_out}")


@pytest.mark.parametrize("n_in", [*N_IN, 8, 16, 17, 300])
@pytest.mark.parametrize("kernel", KERNELS)
def test_dot_matches_float64_reference(kernel: str, n_in: int) -> None:
    rng = np.random.default_rng([n_in, 77])
    for n_tokens in [*TOKENS, 3, 65]:
        x, w, b = random_layer(rng, n_tokens, n_in, 1)
        y = _core.kernel_dot(kernel, x, w[0], float(b[0]))
        ref = x.astype(np.float64) @ w[0].astype(np.float64) + np.float64(b[0])
        assert_close(y, ref, f"{kernel} dot T={n_tokens} n_in={n_in}")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_activations_over_the_whole_float_range(kernel: str, activation: str) -> None:
    """One input, weight 1, bias 0: the layer output is x itself, so this probes the activation alone, from tiny
    through exp's overflow and underflow thresholds to near FLT_MAX."""
    magnitudes = np.concatenate([np.logspace(-30, 38, 400), [0.6249, 0.625, 0.6251, 44, 87, 88.7, 89, 104, 105]])
    x = np.concatenate([[0.0], magnitudes, -magnitudes, np.linspace(-120, 120, 4801)])
    x = x.astype(np.float32).reshape(-1, 1)
    y = _core.kernel_dense(kernel, x, np.ones((1, 1), np.float32), np.zeros(1, np.float32), activation, True)
    ref = reference_activation(activation, x.astype(np.float64))
    assert np.isfinite(y).all(), f"{kernel} {activation}: non-finite output for finite input {x[~np.isfinite(y)]}"
    assert_close(y, ref, f"{kernel} {activation} wide range")


@pytest.mark.parametrize("kernel", KERNELS)
def test_simd_activations_agree_with_scalar_closely(kernel: str) -> None:
    """Tighter than the float64 check: the vector exp/tanh stay within a few float ulps of the scalar path."""
    x = np.linspace(-30, 30, 60001, dtype=np.float32).reshape(-1, 1)
    one, zero = np.ones((1, 1), np.float32), np.zeros(1, np.float32)
    for activation in ACTIVATIONS:
        got = _core.kernel_dense(kernel, x, one, zero, activation, True).astype(np.float64)
        want = _core.kernel_dense("scalar", x, one, zero, activation, True).astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7, err_msg=f"{kernel} {activation}")


def test_unknown_kernel_name_is_a_value_error() -> None:
    x, w, b = random_layer(np.random.default_rng(0), 2, 3, 4)
    with pytest.raises(ValueError, match="kernel set 'bogus' is unknown; available: scalar"):
        _core.kernel_dense("bogus", x, w, b, "relu", True)
    with pytest.raises(ValueError, match="bogus"):
        _core.kernel_dot("bogus", x, w[0], 0.0)


# --- which kernel sets, and the KVP_KERNEL override ---------------------------------------------------------------


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


IS_X86 = platform.machine().lower() in ("x86_64", "amd64")
IS_ARM64 = platform.machine().lower() in ("aarch64", "arm64")


def test_scalar_is_always_available_and_listed_first() -> None:
    assert KERNELS[0] == "scalar"
    assert len(set(KERNELS)) == len(KERNELS)


@pytest.mark.skipif(not IS_X86 or not os.path.exists("/proc/cpuinfo"), reason="x86 Linux only")
def test_x86_lists_the_sets_this_cpu_supports() -> None:
    flags = cpu_flags()
    expected = ["scalar"]
    if {"avx2", "fma", "f16c"} <= flags:
        expected.append("avx2")
    # avx512.cpp is compiled with -mavx512f/vl/bw/dq, so the compiler may use any of them.
    if {"avx512f", "avx512vl", "avx512bw", "avx512dq", "fma"} <= flags:
        expected.append("avx512")
    assert KERNELS == expected


@pytest.mark.skipif(not IS_ARM64, reason="AArch64 only")
def test_aarch64_lists_neon() -> None:
    assert KERNELS == ["scalar", "neon"]


def selected_in_subprocess(kvp_kernel: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVP_KERNEL"}
    if kvp_kernel is not None:
        env["KVP_KERNEL"] = kvp_kernel
    return subprocess.run(
        [sys.executable, "-c", "from kvp_cpp import _core; print(_core.selected_kernel())"],
        env=env, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize("kvp_kernel", [None, "", "auto"], ids=["unset", "empty", "auto"])
def test_default_selection_is_the_most_capable_set(kvp_kernel: str | None) -> None:
    result = selected_in_subprocess(kvp_kernel)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == KERNELS[-1]


@pytest.mark.parametrize("kernel", KERNELS)
def test_kvp_kernel_forces_a_set(kernel: str) -> None:
    result = selected_in_subprocess(kernel)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == kernel


def test_bogus_kvp_kernel_is_a_clear_error() -> None:
    result = selected_in_subprocess("bogus")
    assert result.returncode != 0
    assert "ValueError" in result.stderr
    assert f"KVP_KERNEL=bogus: kernel set 'bogus' is unknown; available: {', '.join(KERNELS)} (or auto)" in (
        result.stderr
    )


def test_kvp_kernel_naming_a_set_this_machine_lacks_is_an_error() -> None:
    missing = next(name for name in ["neon", "avx512", "avx2"] if name not in KERNELS)
    result = selected_in_subprocess(missing)
    assert result.returncode != 0
    assert f"kernel set '{missing}' is not built for or not supported by this CPU" in result.stderr
    assert f"available: {', '.join(KERNELS)}" in result.stderr
