"""The edge side of the edge-cloud split (DESIGN.md §6): wire protocol, remote verifier, gating."""
