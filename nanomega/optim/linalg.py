"""Shared matrix maths for the matrix optimizers, in the precision each step needs.

Sections: Newton-Schulz orthogonalization (Muon); inverse matrix roots (Shampoo);
eigenbases and their QR power-iteration refresh (SOAP).
"""
from __future__ import annotations

import torch


# ---------------------------------------------------------------- Newton-Schulz (Muon)


# ---------------------------------------------------------------- inverse roots (Shampoo)


# ---------------------------------------------------------------- eigenbases (SOAP)
