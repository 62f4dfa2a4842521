"""The tables bench/report.py renders from bench/results/*.json, one module a kind of row:
results (loading, machine labels), micro_rows, demo_rows, real_rows, tables (the full table
and the README's headline), gpu_tables. bench/peer_table.py renders the peer ratios."""
