"""All kernel benchmark tables: python -m tests.bench; the roofline prediction instead, no kernel run:
python -m tests.bench --predict [--model ...] [--tau T] [--ctx N] [--tbs TB/s] (tests/bench/roofline.py)."""
import sys

if "--predict" in sys.argv[1:]:
    from tests.bench import roofline

    roofline.main([a for a in sys.argv[1:] if a != "--predict"])
elif sys.argv[1:] in ([], ["--run"]):
    from tests.bench import bench_attention, bench_mamba

    bench_mamba.main()
    bench_attention.main()
else:
    sys.exit(f"usage: python -m tests.bench [--predict [options of tests/bench/roofline.py]]; got {sys.argv[1:]}")
