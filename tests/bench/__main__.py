"""All kernel benchmark tables: python -m tests.bench"""
from tests.bench import bench_attention, bench_mamba

bench_mamba.main()
bench_attention.main()
