"""Use the planner on your own Flax NNX module: trace, place on 2 devices, train 4 x 2 hybrid.

  python experiments/examples/own_nnx.py

Prints the plan (which module runs on which model-axis device) and the losses of a few steps,
next to the same steps of the plain single-device model (they agree to float rounding).
"""

from __future__ import annotations

from jaxhybrid import mesh

mesh.simulate_cpu_devices(8)  # before JAX starts: 8 simulated CPU devices for a 4x2 mesh

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxhybrid.api  # noqa: E402


class Tower(nnx.Module):
  def __init__(self, din: int, width: int, *, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(din, width, rngs=rngs)
    self.l2 = nnx.Linear(width, 1, rngs=rngs)

  def __call__(self, x):  # [batch, din] -> [batch, 1]
    return self.l2(jax.nn.relu(self.l1(x)))


class TwoTowers(nnx.Module):
  """Two independent towers: the planner can run them at the same time on two devices."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.left = Tower(16, 64, rngs=rngs)
    self.right = Tower(16, 64, rngs=rngs)

  def __call__(self, x):
    return self.left(x) + self.right(x)


def loss_fn(model: TwoTowers, batch: dict[str, jax.Array]) -> jax.Array:
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def make_batch(step: int, size: int = 32) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(step)
  x = rng.normal(size=(size, 16)).astype(np.float32)
  return {"x": x, "y": np.sin(x[:, :1])}


def main() -> tuple[list[float], list[float]]:
  """Returns the hybrid and the single-device losses of 4 steps."""
  model = TwoTowers(rngs=nnx.Rngs(0))
  reference = nnx.clone(model)
  hybrid = jaxhybrid.api.parallelize(
    model, loss_fn, optax.adam(1e-2), make_batch(0), mesh="4x2", microbatches=2,
    planner="milp", planner_options={"time_limit_s": 10},
  )
  print(hybrid.plan.summary())
  state = hybrid.init()
  opt = nnx.Optimizer(reference, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def reference_step(m, o, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(m, batch)
    o.update(m, grads)
    return loss

  losses, ref_losses = [], []
  for step in range(4):
    state, metrics = hybrid.step(state, make_batch(step))
    ref = reference_step(reference, opt, make_batch(step))
    losses.append(float(metrics["loss"]))
    ref_losses.append(float(ref))
    print(f"step {step}: hybrid loss {float(metrics['loss']):.6f}, single device {float(ref):.6f}")
  return losses, ref_losses


if __name__ == "__main__":
  main()
