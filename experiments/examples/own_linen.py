"""Use the planner on your own Flax linen module: trace, place on 2 devices, train 4 x 2 hybrid.

  python experiments/examples/own_linen.py

A linen model passes its concrete parameters (`params=`) and a loss of `(params, batch)` that
calls `model.apply` itself. Prints the plan and a few losses next to plain single-device steps.
"""

from __future__ import annotations

from jaxhybrid import mesh

mesh.simulate_cpu_devices(8)  # before JAX starts: 8 simulated CPU devices for a 4x2 mesh

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402

import jaxhybrid.api  # noqa: E402


class Tower(nn.Module):
  width: int = 64

  @nn.compact
  def __call__(self, x):  # [batch, din] -> [batch, 1]
    return nn.Dense(1, name="l2")(jax.nn.relu(nn.Dense(self.width, name="l1")(x)))


class TwoTowers(nn.Module):
  """Two independent towers: the planner can run them at the same time on two devices."""

  def setup(self):
    self.left = Tower()
    self.right = Tower()

  def __call__(self, x):
    return self.left(x) + self.right(x)


MODEL = TwoTowers()


def loss_fn(params, batch: dict[str, jax.Array]) -> jax.Array:
  return jnp.mean((MODEL.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)


def make_batch(step: int, size: int = 32) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(step)
  x = rng.normal(size=(size, 16)).astype(np.float32)
  return {"x": x, "y": np.sin(x[:, :1])}


def main() -> tuple[list[float], list[float]]:
  """Returns the hybrid and the single-device losses of 4 steps."""
  params = MODEL.init(jax.random.key(0), make_batch(0)["x"])["params"]
  tx = optax.adam(1e-2)
  hybrid = jaxhybrid.api.parallelize(
    MODEL, loss_fn, tx, make_batch(0), params=params, mesh="4x2", microbatches=2,
    planner="milp", planner_options={"time_limit_s": 10},
  )
  print(hybrid.plan.summary())
  state = hybrid.init()

  @jax.jit
  def reference_step(p, o, batch):
    loss, grads = jax.value_and_grad(loss_fn)(p, batch)
    updates, o = tx.update(grads, o, p)
    return optax.apply_updates(p, updates), o, loss

  ref_params, ref_opt = params, tx.init(params)
  losses, ref_losses = [], []
  for step in range(4):
    state, metrics = hybrid.step(state, make_batch(step))
    ref_params, ref_opt, ref = reference_step(ref_params, ref_opt, make_batch(step))
    losses.append(float(metrics["loss"]))
    ref_losses.append(float(ref))
    print(f"step {step}: hybrid loss {float(metrics['loss']):.6f}, single device {float(ref):.6f}")
  return losses, ref_losses


if __name__ == "__main__":
  main()
