"""FactoredMatrix: a low-rank product A·B kept as its two factors, and composition scores between
heads.

Design choices (definitions from TransformerLens's FactoredMatrix and utils.composition_scores, and
Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits"):
- A head's QK circuit W_Q^h W_K^hᵀ and OV circuit W_V^h W_O^h are d_model × d_model matrices of rank
  at most d_head. Kept as (A [..., ldim, mdim], B [..., mdim, rdim]), everything is computed at the
  small size:
  - eigenvalues: the non-zero eigenvalues of AB are those of BA (mdim × mdim), since BAv = λv gives
    AB(Av) = λ(Av);
  - svd: A = Ua Sa Vaᵀ and B = Ub Sb Vbᵀ, then the mdim × mdim middle Sa Vaᵀ Ub Sb = Um Sm Vmᵀ gives
    AB = (Ua Um) Sm (Vb Vm)ᵀ: U [..., ldim, mdim], S [..., mdim], V [..., rdim, mdim] with M = U
    diag(S) Vᵀ;
  - norm: the Frobenius norm, √Σ S².
  Leading axes (layer, head) broadcast, so `model.OV` is one FactoredMatrix of shape [layer, head,
  d_model, d_model].
- Linear algebra runs in float64 at least (eigen and singular values of float32 products lose
  digits).
- Composition score of a later head's input matrix W (its Q or K side, or its OV) with an earlier
  head's OV
  circuit: ‖W_OV^earlier · W‖_F / (‖W_OV^earlier‖_F ‖W‖_F), computed from the collapsed factors
  (U S and S Vᵀ) so no d_model × d_model product is ever formed.
"""

from __future__ import annotations

from functools import cached_property

import torch


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float64))


class FactoredMatrix:
    """The matrix A @ B [..., ldim, rdim], stored as A [..., ldim, mdim] and B [..., mdim, rdim]."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor) -> None:
        if A.shape[-1] != B.shape[-2]:
            raise ValueError(
                f"factors must share the inner dimension, got A {tuple(A.shape)} and B "
                f"{tuple(B.shape)}"
            )
        lead = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
        self.ldim, self.mdim, self.rdim = A.shape[-2], A.shape[-1], B.shape[-1]
        self.A = A.broadcast_to(*lead, self.ldim, self.mdim)
        self.B = B.broadcast_to(*lead, self.mdim, self.rdim)
        self.shape = torch.Size((*lead, self.ldim, self.rdim))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"FactoredMatrix: Shape({tuple(self.shape)}), Hidden Dim({self.mdim})"

    @property
    def AB(self) -> torch.Tensor:
        """The full product [..., ldim, rdim] (large: d_model² per head)."""
        return self.A @ self.B

    @property
    def BA(self) -> torch.Tensor:
        """The small product [..., mdim, mdim] (needs ldim == rdim)."""
        if self.ldim != self.rdim:
            raise ValueError(f"BA needs a square matrix, this one is {self.ldim} x {self.rdim}")
        return self.B @ self.A

    @property
    def T(self) -> "FactoredMatrix":
        return FactoredMatrix(self.B.transpose(-2, -1), self.A.transpose(-2, -1))

    def __matmul__(self, other: "torch.Tensor | FactoredMatrix") -> "FactoredMatrix":
        if isinstance(other, FactoredMatrix):
            return FactoredMatrix(self.A, (self.B @ other.A) @ other.B)
        return FactoredMatrix(self.A, self.B @ other)

    def __rmatmul__(self, other: torch.Tensor) -> "FactoredMatrix":
        return FactoredMatrix(other @ self.A, self.B)

    def __getitem__(self, index) -> "FactoredMatrix":
        """Index the leading axes: `model.OV[1, 3]` is layer 1, head 3."""
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > self.ndim - 2:
            raise IndexError(
                f"index the leading {self.ndim - 2} axes only, got {len(index)} indices"
            )
        return FactoredMatrix(self.A[index], self.B[index])

    @cached_property
    def _svd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        A, B = _wide(self.A), _wide(self.B)
        Ua, Sa, Vha = torch.linalg.svd(A, full_matrices=False)
        Ub, Sb, Vhb = torch.linalg.svd(B, full_matrices=False)
        middle = Sa[..., :, None] * (Vha @ Ub) * Sb[..., None, :]  # Sa Vaᵀ Ub Sb  [..., mdim, mdim]
        Um, Sm, Vhm = torch.linalg.svd(middle, full_matrices=False)
        return Ua @ Um, Sm, Vhb.transpose(-2, -1) @ Vhm.transpose(-2, -1)

    def svd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(U, S, V) with AB = U diag(S) Vᵀ; U [..., ldim, mdim], S [..., mdim], V [..., rdim,
        mdim]."""
        return self._svd

    @property
    def U(self) -> torch.Tensor:
        return self._svd[0]

    @property
    def S(self) -> torch.Tensor:
        return self._svd[1]

    @property
    def V(self) -> torch.Tensor:
        return self._svd[2]

    @property
    def eigenvalues(self) -> torch.Tensor:
        """The mdim eigenvalues of AB that can be non-zero (those of BA), complex [..., mdim]."""
        return torch.linalg.eigvals(_wide(self.BA))

    def norm(self) -> torch.Tensor:
        """Frobenius norm [...]: √Σ S²."""
        return self.S.pow(2).sum(-1).sqrt()

    def collapse_l(self) -> torch.Tensor:
        """S Vᵀ [..., mdim, rdim]: the matrix with its left orthogonal factor U removed (same norms,
        same products from the right, up to that rotation)."""
        return self.S[..., :, None] * self.V.transpose(-2, -1)

    def collapse_r(self) -> torch.Tensor:
        """U S [..., ldim, mdim]: the matrix with its right orthogonal factor removed."""
        return self.U * self.S[..., None, :]

    def unsqueeze(self, dim: int) -> "FactoredMatrix":
        """Add a leading axis (dim counts among the leading axes, from the front)."""
        return FactoredMatrix(self.A.unsqueeze(dim), self.B.unsqueeze(dim))


def composition_scores(
    left: FactoredMatrix, right: FactoredMatrix, broadcast_dims: bool = True
) -> torch.Tensor:
    """‖left · right‖_F / (‖left‖_F ‖right‖_F) for factored matrices; with broadcast_dims, every
    left (leading axes first) against every right: shape [*left_leading, *right_leading]."""
    if broadcast_dims:
        n_left, n_right = left.ndim - 2, right.ndim - 2
        for i in range(n_left):
            right = right.unsqueeze(i)
        for i in range(n_right):
            left = left.unsqueeze(n_left + i)
    if left.rdim != right.ldim:
        raise ValueError(
            f"composition needs left.rdim == right.ldim, got {left.shape} and {right.shape}"
        )
    l, r = left.collapse_l(), right.collapse_r()  # [..., mdim, d], [..., d, mdim]
    return (l @ r).norm(dim=(-2, -1)) / l.norm(dim=(-2, -1)) / r.norm(dim=(-2, -1))
