from pathlib import Path

# the demo-sized values most RL tests run at (RLConfig's own defaults are a real run's)
DEMO_SIZED = Path(__file__).with_name("demo_sized.yaml")
