"""IR texts more than one program pass's test starts from (tests/test_program_pass_*.py)."""


TWO_BUCKETS = """\
graph train Mlp mesh dp=2
  layers_0_weight: f32[4096, 2048] = param layers.0.weight  # R
  layers_1_weight: f32[4, 4096] = param layers.1.weight  # R
  layers_1_bias: f32[4] = param layers.1.bias  # R
  x: f32[6, 2048] = input args[0]  # S(0)
  y: f32[6, 4] = target targets[0]  # S(0)
  tangent_loss: f32[] = tangent loss  # R
  t_w0: f32[2048, 4096] = aten.t.default(layers_0_weight)  # fwd R
  h: f32[6, 4096] = aten.mm.default(x, t_w0)  # fwd S(0)
  r: f32[6, 4096] = aten.relu.default(h)  # fwd S(0)
  t_w1: f32[4096, 4] = aten.t.default(layers_1_weight)  # fwd R
  o: f32[6, 4] = aten.addmm.default(layers_1_bias, r, t_w1)  # fwd S(0)
  d: f32[6, 4] = aten.sub.Tensor(o, y)  # fwd S(0)
  sq: f32[6, 4] = aten.mul.Tensor(d, d)  # fwd S(0)
  loss: f32[] = aten.sum.default(sq)  # fwd P
  d2: f32[6, 4] = aten.mul.Tensor(d, 2.0)  # bwd S(0)
  grad_o: f32[6, 4] = aten.mul.Tensor(d2, tangent_loss)  # bwd S(0)
  t_go: f32[4, 6] = aten.t.default(grad_o)  # bwd S(1)
  grad_w1: f32[4, 4096] = aten.mm.default(t_go, r)  # bwd P
  grad_b1: f32[4] = aten.sum.dim_IntList(grad_o, [0])  # bwd P
  t_t_w1: f32[4, 4096] = aten.t.default(t_w1)  # bwd R
  grad_r: f32[6, 4096] = aten.mm.default(grad_o, t_t_w1)  # bwd S(0)
  grad_h: f32[6, 4096] = aten.threshold_backward.default(grad_r, r, 0)  # bwd S(0)
  t_gh: f32[4096, 6] = aten.t.default(grad_h)  # bwd S(1)
  grad_w0: f32[4096, 2048] = aten.mm.default(t_gh, x)  # bwd P
  output loss loss = loss
  output grad layers.0.weight = grad_w0
  output grad layers.1.weight = grad_w1
  output grad layers.1.bias = grad_b1
"""

# Two Linears without bias (torch's layout: the forward reads t(w)), a sum of squares as the
# loss, the batch split over dp. layers.0.weight's 7 rows are 4 per rank (one padding row),
# layers.1.weight's 4 rows 2 per rank. The backward reads layers.1.weight (through t(t(w)),
# for the input gradient of layer 1) but not layers.0.weight (x needs no gradient).
ZERO_MLP = """\
graph train Mlp mesh dp=2
  layers_0_weight: f32[7, 5] = param layers.0.weight  # R
  layers_1_weight: f32[4, 7] = param layers.1.weight  # R
  x: f32[6, 5] = input args[0]  # S(0)
  y: f32[6, 4] = target targets[0]  # S(0)
  tangent_loss: f32[] = tangent loss  # R
  t_w0: f32[5, 7] = aten.t.default(layers_0_weight)  # fwd R
  h: f32[6, 7] = aten.mm.default(x, t_w0)  # fwd S(0)
  r: f32[6, 7] = aten.relu.default(h)  # fwd S(0)
  t_w1: f32[7, 4] = aten.t.default(layers_1_weight)  # fwd R
  o: f32[6, 4] = aten.mm.default(r, t_w1)  # fwd S(0)
  d: f32[6, 4] = aten.sub.Tensor(o, y)  # fwd S(0)
  sq: f32[6, 4] = aten.mul.Tensor(d, d)  # fwd S(0)
  loss: f32[] = aten.sum.default(sq)  # fwd P
  d2: f32[6, 4] = aten.mul.Tensor(d, 2.0)  # bwd S(0)
  grad_o: f32[6, 4] = aten.mul.Tensor(d2, tangent_loss)  # bwd S(0)
  t_go: f32[4, 6] = aten.t.default(grad_o)  # bwd S(1)
  grad_w1: f32[4, 7] = aten.mm.default(t_go, r)  # bwd P
  t_t_w1: f32[4, 7] = aten.t.default(t_w1)  # bwd R
  grad_r: f32[6, 7] = aten.mm.default(grad_o, t_t_w1)  # bwd S(0)
  grad_h: f32[6, 7] = aten.threshold_backward.default(grad_r, r, 0)  # bwd S(0)
  t_gh: f32[7, 6] = aten.t.default(grad_h)  # bwd S(1)
  grad_w0: f32[7, 5] = aten.mm.default(t_gh, x)  # bwd P
  output loss loss = loss
  output grad layers.0.weight = grad_w0
  output grad layers.1.weight = grad_w1
"""

# A 0-d parameter travels as one row: gathered as two, the padding row cut, made 0-d again.
WITH_SCALAR = """\
graph train Scaled mesh dp=2
  w: f32[3, 4] = param w  # R
  scale: f32[] = param scale  # R
  x: f32[6, 3] = input args[0]  # S(0)
  y: f32[6, 4] = target targets[0]  # S(0)
  tangent_loss: f32[] = tangent loss  # R
  h: f32[6, 4] = aten.mm.default(x, w)  # fwd S(0)
  hy: f32[6, 4] = aten.mul.Tensor(h, y)  # fwd S(0)
  err: f32[] = aten.sum.default(hy)  # fwd P
  reg: f32[] = aten.mul.Tensor(scale, scale)  # fwd R
  loss: f32[] = aten.add.Tensor(err, reg)  # fwd R
  grad_h: f32[6, 4] = aten.mul.Tensor(y, tangent_loss)  # bwd S(0)
  t_x: f32[3, 6] = aten.t.default(x)  # bwd S(1)
  grad_w: f32[3, 4] = aten.mm.default(t_x, grad_h)  # bwd P
  two: f32[] = aten.mul.Tensor(scale, 2.0)  # bwd R
  grad_scale: f32[] = aten.mul.Tensor(two, tangent_loss)  # bwd R
  output loss loss = loss
  output grad w = grad_w
  output grad scale = grad_scale
"""
