"""Analytic schedule rules: one folder per target, one module per kernel class (in the spirit
of TVM's `s_tir/dlight`). A rule looks at one PrimFunc and returns a schedule for it, or None
when the function is not of its class; nothing here needs tuning."""
