"""Transfers between model-axis devices: one `lax.ppermute` per message, outside any branch.

`structure.group_messages` decides which of a group's values travel together; `send` runs one
message inside the hybrid program's shard_map.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxhybrid.mesh import MODEL
from jaxhybrid.program.structure import Message


def send(env: dict[tuple[Any, int], jax.Array], msg: Message, me: jax.Array, devices: int) -> None:
  """Runs one message: ONE ppermute carrying every payload of `msg`, then the receivers adopt it.

  A single payload moves as it is. Several are flattened and concatenated per source device
  (zero-padded to the longest source), the device's own buffer is picked by `me`, and each
  receiver slices its payloads back out at static offsets.

  Args:
    env: (value, micro-batch) -> array on this device; the receivers' entries are replaced.
    msg: the message (`structure.group_messages`).
    me: this device's index on the model axis.
    devices: model-axis devices.
  """
  perm = [(src, (src + msg.shift) % devices) for src in sorted(msg.payloads)]
  if sum(len(keys) for keys in msg.payloads.values()) == 1:
    (src, [key]), = msg.payloads.items()
    x = env[key]
    recv = lax.ppermute(x, MODEL, perm=perm)
    env[key] = jnp.where(me == perm[0][1], recv, x)
    return
  flat = {src: [env[key].reshape(-1) for key in keys] for src, keys in msg.payloads.items()}
  length = max(sum(x.size for x in xs) for xs in flat.values())
  buf = None
  for src, xs in sorted(flat.items()):
    used = sum(x.size for x in xs)
    part = jnp.concatenate(xs + ([jnp.zeros((length - used,), msg.dtype)] if used < length else []))
    buf = part if buf is None else jnp.where(me == src, part, buf)
  recv = lax.ppermute(buf, MODEL, perm=perm)
  for src, keys in msg.payloads.items():
    dst, off = (src + msg.shift) % devices, 0
    for key in keys:
      x = env[key]
      seg = lax.slice(recv, (off,), (off + x.size,)).reshape(x.shape)
      env[key] = jnp.where(me == dst, seg, x)
      off += x.size
