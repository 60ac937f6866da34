"""Several of a rank's clients trained at once as one batched model (``clients_at_once`` > 1).

For small models one client's optimizer step is mostly Python and kernel-launch overhead.
Here K clients of a rank train together: their flat states are the rows of one (K, P)
tensor ``theta``; the model's forward runs once per step over all K clients, the K
per-client losses are summed and differentiated with ordinary autograd (client k's loss
depends on row k only, so the gradient of the sum is every client's own gradient), and one
functional SGD step updates all rows with a handful of whole-(K, P) kernels.

The forward over K clients is one of two, chosen per model (:func:`stacked_forward`):

* grouped kernels, for models whose parametrised modules are all ``nn.Linear`` / ``nn.Conv2d``:
  the model's own forward on the K batches folded into one (K*B, ...), each Linear a ``bmm``
  and each Conv2d one convolution with K times the groups. Checked once per model against
  vmap on a real batch, since folding is wrong for a forward that mixes samples;
* ``torch.func.vmap`` of ``functional_call`` otherwise (any model vmap supports).

Either way the autograd leaves are (K, *shape) views of ``theta`` (not ``theta`` itself):
differentiating through slices of one big leaf would materialise a (K, P) zero gradient per
parameter tensor, which cost more than the model's own backward on the small models this is for.

Reverse-mode autograd outside ``vmap`` (rather than ``vmap(grad(...))``) keeps FedMix's
second-order term expressible as it is in the sequential path: the input gradient is a
``torch.autograd.grad(..., create_graph=True)`` on the summed losses, whose slice k is
client k's own dL_k/dx_k.

Equal to the sequential path (within float rounding), client by client:

* batch order: each client's batches are the ones :meth:`ClientContext.batches` yields for
  it (same permutation, same augmentation stream), one epoch at a time;
* unequal sizes: a client with fewer steps in an epoch is *masked out* of the later steps
  (its parameters AND its momentum stay exactly as they are: ``torch.where``, not a
  multiplication by 0); a short last batch is padded and the padded rows get weight 0, so the
  loss is the mean over the real samples only (per-sample weights 1/n_real);
* optimizer: SGD as ``torch.optim.SGD`` runs it (weight decay added to the gradient, momentum
  buffer started at the first gradient, no dampening, ``--nesterov`` as torch does it), after
  the per-client ``clip_grad_norm_`` when ``--grad-clip`` > 0; ``--optimizer adam`` as
  ``torch.optim.Adam`` runs it (:class:`StackedAdam`: each client's own step count, so its bias
  corrections are those of its own steps).

Who is batched: an algorithm opts in with the class attribute ``batchable = True`` and a
hook ``batched_loss(group, x, y, weight) -> (K,)`` (see :class:`ClientGroup`); the
sequential ``loss`` stays the reference. Today: FedAvg, FedProx, NaiveMix, FedMix, LocalMix,
GlobalMix, Mixup, MOON, FedAlign, StochDepth (each client's own dropped blocks: ``ClientGroup.skip``),
GradAug (each client's sub-networks on its own: :func:`client_stream`), and the personalised
FedPer, LG-FedAvg, FedSim, pMixFed (-Dynamic), FedBABU, FedAlt, Ditto and Per-FedAvg (its
meta-steps in its ``batched_local_update``), whose ``download`` builds the model a client trains
(personal layers, pMixFed's mix) before the batched steps start, as it does before the sequential ones; and the FD
family's devices (FD on its own model and teacher table, FLD / MixFLD / Mix2FLD on the global
model), each adding its own per-label output sums (Eq. 2) as one stacked table
(:class:`fedhpc.exchanges.label_outputs.GroupLabelOutputs`). A subclass that overrides a hook of
the local update (``LOCAL_UPDATE_HOOKS``: ``loss``, ``local_update``, ``make_optimizer``,
``mix_loss``, the personalised family's phases, Per-FedAvg's meta-gradient...) without declaring
``batchable`` itself is refused, so a method never inherits a batched path that no longer matches its
loss; a method refused may say why (``not_batchable_because``: the one-shot methods, whose devices
do not train).

An update with phases, frozen parts or a second model overrides ``batched_local_update(group)``
(default: one :func:`train_group` call), mirroring its ``local_update`` with
:class:`GroupTraining`: ``group.train(states, epochs, first_epoch, loss)`` is one phase of the
sequential ``train_epochs`` (a fresh stacked optimiser, epochs numbered from ``first_epoch``), over
the parameters that require grad in the model *now*: run under the same ``frozen(...)`` as the
sequential phase, a frozen parameter takes no gradient, no momentum and no weight decay, and a
frozen BatchNorm normalises with each client's running statistics and leaves them as they are.
FedBABU trains one phase with its head frozen, FedAlt its personal phase then its shared phase.
``group.stacked(model, flat, states)`` is another model of each client's, stepped inside a phase's
loss: Ditto's personal models, whose steps precede each global step on the same batch, from the
same dropout streams (``batched_downloaded`` / ``batched_hand_back`` carry such a model's start
and trained state past the other clients' downloads to each client's upload).

Dropout and BatchNorm, on the grouped kernels (every parametrised module a Linear, Conv2d or
BatchNorm1d/2d/3d; the vmap path refuses them with a ConfigError naming the fix):

* dropout (``nn.Dropout``, ``Dropout1d/2d/3d``): the sequential path draws client k's masks
  from torch's default generator of the model's device, seeded for the client before its
  download (``seed_torch(derive_seed(seed, "client", round, cid))``). Here each client's
  generator state is taken just after its download and every dropout call draws client k's
  mask with that state swapped in, by the same function on a tensor of ones of client k's real
  rows (so the same shape, the same op and the same stream position as its sequential step),
  then puts the advanced state back: masks bit for bit the sequential ones, on any device.
  A client masked out of a step draws nothing; after the group trains, torch's generator is
  left at each client's own state while its upload is taken, as the sequential loop leaves it;
* BatchNorm: each client's batch statistics over its own real rows (padding excluded) and its
  running statistics as rows of a stacked (K, C) buffer, updated as ``F.batch_norm`` updates
  them (momentum, unbiased variance), and written back into the client's flat state. Equal to
  the sequential path within float rounding (the statistics are reduced in another order).

Either needs to know which rows of a forward's input are real: a hook's ``group.forward(x)`` on a
(K, B, ...) batch of the step's B rows reads the step's counts; another row count must pass its
own (``group.forward(x, real=[...])``), or a model with dropout or BatchNorm refuses the call.
Only classification tasks are batched (next-character prediction, with its per-position labels,
recurrent models and embedding-space mixing, is refused).
"""

# The pieces, in the order a step meets them (one file each): who may be batched (refusal), what a
# method's hook sees (group), the stacked forward (kernels), the stacked optimisers (optim), an
# epoch's padded batches (epochs), training a group and the engine's loop over groups (training).
from .epochs import EpochBatches, epoch_batches
from .group import ClientGroup, add_proximal_terms, client_stream, client_weights, proximal_terms, weighted_task_loss
from .kernels import (CLIENT_DROPOUTS, GROUPED_MODULES, GROUPED_NORMS, StepRows, device_generator, grouped_forward,
                      stacked_buffers, stacked_forward, stacked_params, stochastic_layers, vmap_forward)
from .optim import StackedAdam, StackedSGD
from .refusal import LOCAL_UPDATE_HOOKS, check_batchable, method_refusal
from .training import GroupTraining, StackedModel, client_rng_states, train_group, train_in_groups

__all__ = ["CLIENT_DROPOUTS", "GROUPED_MODULES", "GROUPED_NORMS", "LOCAL_UPDATE_HOOKS", "ClientGroup", "EpochBatches",
           "GroupTraining", "StackedAdam", "StackedModel", "StackedSGD", "StepRows", "add_proximal_terms",
           "check_batchable", "client_rng_states", "client_stream", "client_weights", "device_generator",
           "epoch_batches", "grouped_forward", "method_refusal", "proximal_terms", "stacked_buffers",
           "stacked_forward", "stacked_params", "stochastic_layers", "train_group", "train_in_groups",
           "vmap_forward", "weighted_task_loss"]
