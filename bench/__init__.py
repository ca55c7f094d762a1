"""meshca's benchmarks: figures and ratios against a baseline from the same run, not timed tests.

Each module is a script run from the repository root as `python -m bench.NAME` (`--help` lists
its options); docs/performance.md says what each measures. A bench imports the product and
`tests.support` (the suite's shared helpers), never a test folder's own helpers.
"""
