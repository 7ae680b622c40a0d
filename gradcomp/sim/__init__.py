"""Described clusters, measured cost profiles, the cost model and the timeline simulator.

Paper 000 §4.3 (eq. 7) and DESIGN §6. Shared by LayerFusion, the schemes and the
benchmarks; imports compressors (for a profile's label) and models (for a
model's workload), never fusion, schemes or bench.
"""
