"""Shared matrix maths for the matrix optimizers, in the precision each step needs.

Sections: the helpers Shampoo and SOAP share (Kronecker factors' Gram products, a matrix applied along
every dim, the working precision, a branch that compiles); Newton-Schulz orthogonalization (Muon);
blocking and inverse matrix roots (Shampoo); eigenbases and their QR power-iteration refresh (SOAP).
"""
from __future__ import annotations

import itertools

import torch
from torch._subclasses.fake_tensor import is_fake

from nanomega.tree import tree_map

# ---------------------------------------------------------------- shared by Shampoo and SOAP

def gram(x: torch.Tensor, dim: int) -> torch.Tensor:
    """X_(dim) X_(dim)^T: x's mode-`dim` unfolding times its transpose (every other dim contracted)."""
    others = [d for d in range(x.ndim) if d != dim]
    return torch.tensordot(x, x, dims=(others, others))


def accumulate(L: torch.Tensor, gram_: torch.Tensor, beta: float) -> torch.Tensor:
    """A Kronecker factor taking a gradient's gram: beta L + (1 - beta) G G^T, or for beta = 1 the AdaGrad-style
    sum L + G G^T (an EMA with beta = 1 would keep the factor at its zeros)."""
    return L + gram_ if beta == 1.0 else torch.lerp(L, gram_, 1.0 - beta)


def along_dims(x: torch.Tensor, matrices: list, back: bool = False) -> torch.Tensor:
    """M_i^T applied along every dim i of x (x's coordinates in the columns of M_i: SOAP's rotation into its
    eigenbases; Shampoo's roots, symmetric), or M_i with `back` (SOAP's rotation back); a None leaves dim i as
    it is. Each turn contracts dim 0 and appends the result's index last (tensordot's order), or just moves dim 0
    last: after x.ndim turns every dim is back in its place."""
    for M in matrices:
        x = x.movedim(0, -1) if M is None else torch.tensordot(x, M, dims=([0], [1 if back else 0]))
    return x


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision of factors, roots and bases: fp32, or fp64 for fp64 parameters."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def unaliased(tree):
    """tree itself in eager mode; copies of its tensors when compiling, where a torch.cond branch may not
    return its inputs (aliasing is rejected): the "keep" branch of a refresh."""
    return tree_map(torch.clone, tree) if torch.compiler.is_compiling() else tree


def has_values(x: torch.Tensor) -> bool:
    """False for meta and fake tensors (shapes only: sim.estimate's simulation), whose values cannot be read."""
    return x.device.type != "meta" and not is_fake(x)


def branch(pred: torch.Tensor, true_fn, false_fn, operands: tuple):
    """true_fn(*operands) if pred else false_fn(*operands), for a boolean scalar tensor `pred`.

    Eager: an ordinary Python `if` (one host sync to read pred), so only the chosen branch runs.
    Under torch.compile: torch.cond, which keeps the decision in the graph (no graph break, no
    recompile when pred changes) and still runs only the chosen branch. Both branches must return
    the same structure of tensors of the same shapes and dtypes, and must not return an operand
    itself when traced (cond rejects aliased outputs: a "keep" branch clones, at least under compile).

    pred lives where the optimizer's counts live, on the parameters' device (base.scalar_state), so on a
    GPU either way reads it on the host (torch.cond's generated code calls .item() on it): one sync per
    branch, the price of running only the branch taken. On "meta" or fake tensors (shapes, no values:
    nanomega.sim.estimate's simulation) nothing can be read: both branches run, so a shape or device check
    sees every op of either, and the first's result stands for both (they agree in structure, shapes and
    dtypes).
    """
    if torch.compiler.is_compiling():
        return torch.cond(pred, true_fn, false_fn, tuple(operands))
    if not has_values(pred):
        false_fn(*operands)
        return true_fn(*operands)
    return true_fn(*operands) if bool(pred) else false_fn(*operands)


# ---------------------------------------------------------------- Newton-Schulz (Muon)

def ns_schedule(coefficients, steps: int) -> list[tuple[float, float, float]]:
    """One (a, b, c) per Newton-Schulz step: one triple for every step, or a sequence of triples, one
    per step (Polar Express), whose last repeats if there are more steps than triples."""
    if len(coefficients) == 3 and all(isinstance(x, (int, float)) for x in coefficients):
        return [tuple(coefficients)] * steps
    return [tuple(coefficients[min(i, len(coefficients) - 1)]) for i in range(steps)]


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)     # Keller Jordan's, every step


def newton_schulz(G: torch.Tensor, steps: int = 5, coefficients=NS_COEFFICIENTS,
                  eps: float = 1e-7, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximately orthogonalize G = U S V^T to U S' V^T with S' ~ 1, for a matrix or a batch [..., m, n].

    Each step applies the odd quintic p(x) = a x + b x^3 + c x^5 to every singular value at once:
    X <- a X + (b A + c A^2) X with A = X X^T. The default coefficients (Keller Jordan's) maximise
    the slope at 0 (a = 3.4445) so that small singular values grow quickly; the price is that after
    5 steps the values oscillate in roughly [0.68, 1.2] instead of converging to 1, which Muon does
    not mind. `coefficients` may instead hold one triple per step (ns_schedule: Polar Express's, which
    end in [0.85, 1.14] where these end in [0.47, 1.2] for values from 1e-3). The iteration runs in
    `dtype` (bf16 by default: matmul-bound, it tolerates the noise); the result has G's dtype.
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a batch of matrices, got shape {tuple(G.shape)}")
    m, n = G.shape[-2:]
    # Cast first and normalise in `dtype`, in the order torch.optim.Muon uses, so that in bf16 the
    # two agree bit for bit (torch divides by max(norm, eps), not norm + eps: the same in bf16
    # unless the norm is ~eps). bf16 has fp32's exponent range, so the cast cannot overflow.
    X = G.to(dtype)
    # Work on the wide orientation: the Gram matrix X X^T is then min(m, n)^2, the cheaper one.
    if m > n:
        X = X.mT
    batch = X.shape[:-2]
    if X.ndim > 3:  # [..., m, n] -> [B, m, n]: baddbmm takes one batch dimension
        X = X.reshape(-1, *X.shape[-2:])
    # ||X||_2 <= ||X||_F, so every singular value starts in [0, 1], inside p's basin of attraction.
    X = X / (torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) + eps)
    # Fused multiply-adds: in bf16 each step rounds once (separate ops would round b*A, c*A@A and
    # their sum each: about as accurate, but no longer bit-identical to torch.optim.Muon).
    mul_add = torch.addmm if X.ndim == 2 else torch.baddbmm
    for a, b, c in ns_schedule(coefficients, steps):
        A = X @ X.mT
        B = mul_add(A, A, A, beta=b, alpha=c)    # b A + c A^2
        X = mul_add(X, B, X, beta=a)             # a X + B X
    X = X.reshape(*batch, *X.shape[-2:])
    if m > n:
        X = X.mT
    return X.to(G.dtype).contiguous()  # tall results are transposed views; updates should be dense


# ---------------------------------------------------------------- blocks and inverse roots (Shampoo)

def block_grid(shape, max_dim: int) -> list[tuple[slice, ...]]:
    """Shampoo's blocks: index tuples in row-major order, each dimension cut into chunks of max_dim, the last
    one shorter (torch.split's convention)."""
    per_dim = [[slice(a, min(a + max_dim, n)) for a in range(0, n, max_dim)] for n in shape]
    return list(itertools.product(*per_dim))


def _eigh(A: torch.Tensor):
    """torch.linalg.eigh; its own name so that tests can make one precision fail on purpose."""
    return torch.linalg.eigh(A)


def _inverse_root_in(A: torch.Tensor, p: float, eps: float, rel_floor: float, dtype: torch.dtype):
    """(A^(-1/p), ok) computed entirely in `dtype`; ok[...] is False where the input or the root is non-finite,
    or (all of them) where LAPACK fails to converge."""
    A = A.to(dtype)
    finite_in = torch.isfinite(A).all(dim=(-2, -1))
    # LAPACK raises on a NaN input (CPU) and returns garbage on an infinite one: decompose the identity
    # there instead (its result is discarded, ok says so), so a bad factor never raises inside a graph.
    eye = torch.eye(A.shape[-1], dtype=dtype, device=A.device)
    A = torch.where(finite_in[..., None, None], A, eye)
    # eigh reads one triangle only; an accumulated G G^T is symmetric up to rounding, so make it exact.
    A = 0.5 * (A + A.mT)
    if torch.compiler.is_compiling():   # a traced graph cannot catch a LAPACK error; its usual cause is defused above
        lam, Q = _eigh(A)
    else:
        try:
            lam, Q = _eigh(A)
        except torch.linalg.LinAlgError:  # one matrix of a batch failed; we cannot tell which: all fail
            return (torch.full(A.shape, float("nan"), dtype=dtype, device=A.device),
                    torch.zeros(A.shape[:-2], dtype=torch.bool, device=A.device))
    # The epsilon rule. eigh sorts ascending, so lam[..., -1] is the largest eigenvalue.
    #  1. Floor: eigenvalues below rel_floor * lam_max are raised to it. In fp32 the small eigenvalues
    #     of an ill-conditioned factor are rounding noise of size ~1e-7 * lam_max (and may be
    #     negative); the floor caps the condition number at 1/rel_floor, so the root's gain on
    #     noise directions is at most rel_floor^(-1/p) times its gain on the top direction.
    #  2. Shift: eps is added to every eigenvalue, i.e. the root is that of (A + eps * I) with the
    #     floor applied. Added to the eigenvalues rather than to A's diagonal because in fp32 an
    #     eps below ulp(A_ii) (1e-12 against entries ~1) would vanish; it keeps the root finite for
    #     an all-zero factor (root = eps^(-1/p) I).
    lam_max = lam[..., -1:].clamp_min(0.0)
    lam = torch.maximum(lam, rel_floor * lam_max) + eps
    root = (Q * lam.pow(-1.0 / p).unsqueeze(-2)) @ Q.mT
    ok = finite_in & torch.isfinite(root).all(dim=(-2, -1))
    return root, ok


def matrix_inverse_root(A: torch.Tensor, p: float, eps: float = 1e-12,
                        rel_floor: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(A^(-1/p), ok) for a symmetric PSD matrix or a batch [..., n, n], by eigendecomposition.

    With A = Q diag(lam) Q^T: root = Q diag(lam'^(-1/p)) Q^T, lam' = max(lam, rel_floor * lam_max) + eps
    (see _inverse_root_in for why). The decomposition runs in fp32 (fp64 for an fp64 A); where it
    fails (LAPACK error, or a non-finite root) the matrix is redone in fp64. The root
    comes back in that working dtype (fp32, or fp64 for an fp64 A).

    ok: a bool tensor of shape A.shape[:-2], True where the root is finite. Where it is False the
    root is meaningless (NaN): callers keep their previous root there.
    """
    dtype = compute_dtype(A.dtype)
    root, ok = _inverse_root_in(A, p, eps, rel_floor, dtype)
    if dtype == torch.float64:
        return root, ok

    def keep(root, ok, A):
        return root.clone(), ok.clone()

    def retry(root, ok, A):  # whole batch in fp64 (failures are rare); fp32 results stay where they were fine
        root64, ok64 = _inverse_root_in(A, p, eps, rel_floor, torch.float64)
        return torch.where(ok[..., None, None], root, root64.to(dtype)), ok | ok64

    return branch(ok.all(), keep, retry, (root, ok, A))


def inverse_roots(factors: list, orders: list, previous: list, eps: float = 1e-12, rel_floor: float = 1e-6):
    """([factors[i]^(-1/orders[i])], failures) by matrix_inverse_root, one batched eigh per (size, order,
    dtype): fewer, larger kernels than one per factor. Where a root fails (non-finite in fp32 and in
    fp64) previous[i] is kept, and `failures` (an int64 scalar) counts those."""
    new, failed = list(previous), factors[0].new_zeros((), dtype=torch.int64)
    groups: dict[tuple, list[int]] = {}
    for i, f in enumerate(factors):
        groups.setdefault((f.shape[-1], orders[i], f.dtype), []).append(i)
    for (_, order, _), idx in groups.items():
        root, ok = matrix_inverse_root(torch.stack([factors[i] for i in idx]), order, eps, rel_floor)
        for j, i in enumerate(idx):
            new[i] = torch.where(ok[j], root[j].to(previous[i].dtype), previous[i])
        failed = failed + (~ok).sum()
    return new, failed


# ---------------------------------------------------------------- eigenbases (SOAP)

def eigenbasis(factor: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """Orthonormal eigenvectors of the symmetric PSD `factor`, as columns sorted by descending eigenvalue.

    eigh runs in fp32 (fp64 for an fp64 factor), retried in fp64 when it fails to converge or returns
    non-finite values. Under torch.compile a failure cannot be caught inside the graph, so there it
    runs in fp64 straight away: SOAP calls this once per run (step 1), so the cost does not matter.
    `eps` * I shifts every eigenvalue and leaves the eigenvectors as they are (the conventional
    shampoo_eps shift). The result has the factor's dtype.
    """
    eye = torch.eye(factor.shape[-1], dtype=factor.dtype, device=factor.device)
    shifted = factor + eps * eye
    wide = torch.float64
    if factor.dtype == wide or torch.compiler.is_compiling():
        vectors = torch.linalg.eigh(shifted.to(wide)).eigenvectors
    else:
        try:
            vectors = torch.linalg.eigh(shifted.to(torch.float32)).eigenvectors
            if has_values(vectors) and not torch.isfinite(vectors).all():
                raise torch.linalg.LinAlgError("non-finite eigenvectors")
        except torch.linalg.LinAlgError:
            vectors = torch.linalg.eigh(shifted.to(wide)).eigenvectors
    # eigh sorts ascending; SOAP's refreshes keep the columns in descending order (see below).
    return vectors.flip(-1).to(factor.dtype).contiguous()   # row-major, like the bases it replaces


def refresh_eigenbasis(factor: torch.Tensor, Q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of QR power (subspace) iteration moving Q's columns toward `factor`'s eigenvectors.

    Returns (Q_new, perm): Q's columns are first put in descending order of their eigenvalue estimates
    diag(Q^T F Q) (Rayleigh quotients: exact once Q is the eigenbasis), Q_sorted = Q[:, perm], then
    Q_new = QR(F @ Q_sorted).Q. Sorting first is what makes this converge to the eigenvectors: QR
    orthogonalizes each column against the ones before it, so the dominant directions must come first.
    Column j of Q_new continues column perm[j] of Q, so whatever the caller keeps per basis vector (SOAP's
    second moment) must be re-indexed by `perm` along that dimension. Columns may flip sign (QR fixes
    none); callers that only use Q as a rotation, or square the coordinates, do not care. Costs one
    matmul and one QR, against eigh's much slower (and serial) iteration.
    """
    FQ = factor @ Q
    estimates = (Q * FQ).sum(0)                                   # diag(Q^T F Q) without forming Q^T F Q
    perm = torch.argsort(estimates, descending=True, stable=True)  # stable: ties (a zero cluster) keep their order
    Q_new = torch.linalg.qr(FQ[:, perm]).Q                        # F @ Q[:, perm] == (F @ Q)[:, perm]
    return Q_new.contiguous(), perm                               # LAPACK's column-major -> row-major
