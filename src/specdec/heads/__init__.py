"""Target-aware draft heads (EAGLE-1, EAGLE-3, Medusa, MTP): modules, loading and drafting."""
