"""The edge side of the edge-cloud split: wire protocol, remote verifier, gating."""
