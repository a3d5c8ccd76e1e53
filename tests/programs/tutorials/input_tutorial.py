"""Follows tensorflow/docs site/en/tutorials/distribute/input.ipynb
("Distributed input"), call for call.

Iterating a dataset without a strategy; experimental_distribute_dataset of a
globally batched dataset and next(iter(...)); AutoShardPolicy.DATA through
tf.data.Options; distribute_datasets_from_function with an InputContext
(per-replica batch, shard, batch, prefetch); strategy.run over a for loop of a
distributed dataset, and over next() of its iterator for a number of steps per
epoch; get_next_as_optional with has_value/get_value inside a tf.function
that loops with tf.range and breaks; a tf.function whose input_signature is
the distributed dataset's element_spec; a StringLookup layer made in
strategy.scope() and applied in a dataset_fn; predictions re-ordered by the
indices from Dataset.enumerate and experimental_local_results;
experimental_distribute_values_from_function; Dataset.from_generator.

Adapted (see _tutorial.py): each strategy line (the tutorial creates a
MirroredStrategy() in several cells); its cell that makes two virtual CPUs is
what _tutorial.py does for MirroredStrategy (under MPI each rank is one
device). The tutorial's data are already small and synthetic. What the
tutorial prints per replica is reported from all workers together (under MPI,
experimental_local_results holds this rank's replicas only).
Run with the working directory as argv[1] and as the current directory.
"""

from _tutorial import all_workers, begin, make_strategy, report

begin(keras="keras3")  # either Keras runs it; the default one

import numpy as np
import tensorflow as tf

print(tf.__version__)

numbers = {}  # (report)


def everyone(strategy, per_replica):
    """(report) The values of every replica, from every worker, sorted."""
    local = [
        np.asarray(v).tolist()
        for v in tf.nest.flatten(
            tf.nest.map_structure(lambda v: strategy.experimental_local_results(v), per_replica)
        )
    ]
    return sorted(str(v) for worker in all_workers(local) for v in worker)


print("Available devices:")
for i, device in enumerate(tf.config.list_logical_devices()):
    print("%d) %s" % (i, device))

# -- Without a strategy
global_batch_size = 16
dataset = tf.data.Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(global_batch_size)


@tf.function
def train_step(inputs):
    features, labels = inputs
    return labels - 0.3 * features


numbers["plain_steps"] = []
for inputs in dataset:
    print(train_step(inputs))
    numbers["plain_steps"].append(float(tf.reduce_sum(train_step(inputs))))

# -- tf.distribute.Strategy.experimental_distribute_dataset
global_batch_size = 16
mirrored_strategy = make_strategy()

dataset = tf.data.Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
first = next(iter(dist_dataset))
print(first)
numbers["first_distributed_batch"] = everyone(mirrored_strategy, first)

dataset = tf.data.Dataset.from_tensors(([1.0], [1.0])).repeat(64).batch(16)
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
dataset = dataset.with_options(options)

# -- tf.distribute.Strategy.distribute_datasets_from_function
mirrored_strategy = make_strategy()


def dataset_fn(input_context):
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    dataset = tf.data.Dataset.from_tensors(([1.0], [1.0])).repeat(64).batch(16)
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    dataset = dataset.batch(batch_size)
    dataset = dataset.prefetch(2)
    return dataset


dist_dataset = mirrored_strategy.distribute_datasets_from_function(dataset_fn)
# (report) How the elements fall into replicas depends on the number of input
# pipelines (one under MirroredStrategy, one per rank under MPI) by the
# tutorial's design (shard after batch); how many there are and what they hold
# does not.
numbers["from_function_elements"] = [0, 0.0]
for x in dist_dataset:
    for worker in all_workers(
        [
            np.asarray(v)
            for v in tf.nest.flatten(
                tf.nest.map_structure(mirrored_strategy.experimental_local_results, x)
            )
        ]
    ):
        for v in worker:
            numbers["from_function_elements"][0] += int(v.size)
            numbers["from_function_elements"][1] += float(v.sum())

# -- Distributed iterators: for loop
global_batch_size = 16
mirrored_strategy = make_strategy()
dataset = tf.data.Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)


@tf.function
def train_step(inputs):
    features, labels = inputs
    return labels - 0.3 * features


numbers["for_loop_losses"] = []
for x in dist_dataset:
    loss = mirrored_strategy.run(train_step, args=(x,))
    print("Loss is ", loss)
    numbers["for_loop_losses"].append(everyone(mirrored_strategy, loss))

# -- iter and next
num_epochs = 10
steps_per_epoch = 5
numbers["next_losses"] = []
for _epoch in range(num_epochs):
    dist_iterator = iter(dist_dataset)
    for _step in range(steps_per_epoch):
        loss = mirrored_strategy.run(train_step, args=(next(dist_iterator),))
        print("Loss is ", loss)
        numbers["next_losses"].append(everyone(mirrored_strategy, loss))

# -- Partial batches with get_next_as_optional
global_batch_size = 4
steps_per_loop = 5
strategy = make_strategy()

dataset = tf.data.Dataset.range(9).batch(global_batch_size)
distributed_iterator = iter(strategy.experimental_distribute_dataset(dataset))


@tf.function
def train_fn(distributed_iterator):
    for _ in tf.range(steps_per_loop):
        optional_data = distributed_iterator.get_next_as_optional()
        if not optional_data.has_value():
            break
        per_replica_results = strategy.run(lambda x: x, args=(optional_data.get_value(),))
        tf.print(strategy.experimental_local_results(per_replica_results))


train_fn(distributed_iterator)
# (report) the iterator is exhausted now, on every worker alike
numbers["optional_after_loop_has_value"] = bool(
    distributed_iterator.get_next_as_optional().has_value()
)

# -- element_spec as a tf.function input_signature
global_batch_size = 16
epochs = 5
steps_per_epoch = 5
mirrored_strategy = make_strategy()

dataset = tf.data.Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)


@tf.function(input_signature=[dist_dataset.element_spec])
def train_step(per_replica_inputs):
    def step_fn(inputs):
        return 2 * inputs

    return mirrored_strategy.run(step_fn, args=(per_replica_inputs,))


numbers["element_spec_outputs"] = []
for _ in range(epochs):
    iterator = iter(dist_dataset)
    for _ in range(steps_per_epoch):
        output = train_step(next(iterator))
        tf.print(output)
        numbers["element_spec_outputs"].append(everyone(mirrored_strategy, output))

# -- Preprocessing layers in a dataset_fn
strategy = make_strategy()
vocab = ["a", "b", "c", "d", "f"]

with strategy.scope():
    layer = tf.keras.layers.StringLookup(vocabulary=vocab)


def dataset_fn(input_context):
    dataset = tf.data.Dataset.from_tensor_slices(["a", "c", "e"]).repeat()

    global_batch_size = 4
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    dataset = dataset.batch(batch_size)
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)

    def preprocess_with_kpl(input):
        return layer(input)

    processed_ds = dataset.map(preprocess_with_kpl)
    return processed_ds


distributed_dataset = strategy.distribute_datasets_from_function(dataset_fn)

distributed_dataset_iterator = iter(distributed_dataset)
numbers["lookup_batches"] = []
for _ in range(3):
    batch = next(distributed_dataset_iterator)
    print(batch)
    numbers["lookup_batches"].append(everyone(strategy, batch))

# -- Ordering of predictions by Dataset.enumerate
mirrored_strategy = make_strategy()
dataset_size = 24
batch_size = 6
dataset = tf.data.Dataset.range(dataset_size).enumerate().batch(batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)


def predict(index, inputs):
    outputs = 2 * inputs
    return index, outputs


result = {}
for index, inputs in dist_dataset:
    output_index, outputs = mirrored_strategy.run(predict, args=(index, inputs))
    indices = list(mirrored_strategy.experimental_local_results(output_index))
    rindices = []
    for a in indices:
        rindices.extend(a.numpy())
    outputs = list(mirrored_strategy.experimental_local_results(outputs))
    routputs = []
    for a in outputs:
        routputs.extend(a.numpy())
    for i, value in zip(rindices, routputs):
        result[i] = value

print(result)
# (report) every worker's part of `result`, merged
numbers["predictions_by_index"] = sorted(
    [int(i), int(v)] for part in all_workers(result) for i, v in part.items()
)

# -- Tensor inputs: experimental_distribute_values_from_function
mirrored_strategy = make_strategy()


def value_fn(ctx):
    return tf.constant(ctx.replica_id_in_sync_group)


distributed_values = mirrored_strategy.experimental_distribute_values_from_function(value_fn)
numbers["values_from_function"] = []
for _ in range(4):
    result = mirrored_strategy.run(lambda x: x, args=(distributed_values,))
    print(result)
    numbers["values_from_function"].append(everyone(mirrored_strategy, result))

# -- Dataset.from_generator
mirrored_strategy = make_strategy()


def input_gen():
    while True:
        yield np.random.rand(4)


dataset = tf.data.Dataset.from_generator(
    input_gen, output_types=(tf.float32), output_shapes=tf.TensorShape([4])
)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
iterator = iter(dist_dataset)
numbers["from_generator"] = []
for _ in range(4):
    result = mirrored_strategy.run(lambda x: x, args=(next(iterator),))
    print(result)
    numbers["from_generator"].append(everyone(mirrored_strategy, result))

report(numbers)
