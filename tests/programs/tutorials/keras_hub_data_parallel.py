"""Follows keras-team/keras-io examples/nlp/data_parallel_training_with_keras_hub.py
("Data Parallel Training with KerasHub and tf.distribute"), call for call.

The strategy, the batch size and learning rate scaled by
``num_replicas_in_sync``; training, validation and test datasets
(shuffle(500), batch, cache, prefetch); the total number of training steps
counted from the dataset and a ``PolynomialDecay`` schedule built from it (the
example builds it and then compiles with the constant rate: kept as written); a
``PrintLR`` callback and ``TensorBoard(log_dir="./logs")``; in
``strategy.scope()``: a ``keras_hub.models.BertMaskedLM``, its backbone's
``pooled_dense`` layer frozen, compiled with
``SparseCategoricalCrossentropy(from_logits=True)``, ``AdamW`` and a weighted
``SparseCategoricalAccuracy``, and fit with validation data; then ``evaluate``
on the test data. The event files are read back.

Adapted (see _tutorial.py): the strategy line; the GPU's two logical devices
left out (_tutorial.py makes MirroredStrategy's); no download: the model is
built from a tiny ``BertBackbone`` config (vocabulary 200, 2 layers, 2 heads,
hidden size 16, sequences of 32) with no preprocessor, in place of
``from_preset("bert_tiny_en_uncased")`` (weights and vocabulary cannot be
downloaded here), and wikitext-2's lines are synthetic token sequences in the
form ``BertMaskedLMPreprocessor`` gives (token ids with [MASK]s, segment ids,
padding mask, mask positions; the masked ids as labels and the mask weights as
sample weights), so the filter on the line length is left out; the padding
mask as int32 0/1, not bool (Keras 3.15's ``fit`` under a strategy first
reduces the first batch's shards with MEAN, in ``_maybe_symbolic_build`` of
keras/src/backend/tensorflow/trainer.py, which fails for bool tensors: the
example fails under MirroredStrategy too); 2 of the 3 epochs. Run with the
working directory as argv[1] and as the current directory.
"""

from _tutorial import SEED, begin, checksum, epochs, events, history, make_strategy, report

begin(keras="keras3")

import os

os.environ["KERAS_BACKEND"] = "tensorflow"

import keras
import keras_hub
import numpy as np
import tensorflow as tf

EPOCHS = epochs(3, needed=2)

strategy = make_strategy()
print(f"Number of devices: {strategy.num_replicas_in_sync}")

base_batch_size = 32
base_learning_rate = 1e-4

scaled_batch_size = base_batch_size * strategy.num_replicas_in_sync
scaled_learning_rate = base_learning_rate * strategy.num_replicas_in_sync

# -- The data: what BertMaskedLMPreprocessor makes of wikitext-2's lines (here: synthetic)
VOCABULARY, SEQUENCE, MASKS = 200, 32, 8  # (the tiny config's sizes)
PAD, CLS, SEP, MASK = 0, 2, 3, 4


def masked_lines(n, seed):
    """``n`` lines as BertMaskedLMPreprocessor gives them: (x, y, sample_weight)."""
    rng = np.random.default_rng([SEED, seed])
    token_ids = np.zeros((n, SEQUENCE), np.int32)
    positions = np.zeros((n, MASKS), np.int32)
    mask_ids = np.zeros((n, MASKS), np.int32)
    weights = np.zeros((n, MASKS), np.float32)
    for row in range(n):
        length = rng.integers(12, SEQUENCE - 1)
        token_ids[row, : length + 2] = [CLS, *rng.integers(5, VOCABULARY, length), SEP]
        masked = np.sort(rng.choice(np.arange(1, length + 1), MASKS, replace=False))
        used = rng.integers(3, MASKS + 1)  # 15% of the tokens, at most MASKS
        positions[row, :used] = masked[:used]
        mask_ids[row, :used] = token_ids[row, masked[:used]]
        weights[row, :used] = 1.0
        token_ids[row, masked[:used]] = MASK
    x = {
        "token_ids": token_ids,
        "segment_ids": np.zeros_like(token_ids),
        # (int32, not the preprocessor's bool: Keras 3.15's fit under a strategy
        # first reduces the first batch with MEAN, which fails for bool tensors,
        # under MirroredStrategy too; the backbone takes either)
        "padding_mask": (token_ids != PAD).astype(np.int32),
        "mask_positions": positions,
    }
    return tf.data.Dataset.from_tensor_slices((x, mask_ids, weights))


wiki_train_ds = (
    masked_lines(256, 1)
    .shuffle(buffer_size=500)
    .batch(scaled_batch_size)
    .cache()
    .prefetch(tf.data.AUTOTUNE)
)
wiki_val_ds = (
    masked_lines(64, 2)
    .shuffle(buffer_size=500)
    .batch(scaled_batch_size)
    .cache()
    .prefetch(tf.data.AUTOTUNE)
)
wiki_test_ds = (
    masked_lines(64, 3)
    .shuffle(buffer_size=500)
    .batch(scaled_batch_size)
    .cache()
    .prefetch(tf.data.AUTOTUNE)
)

total_training_steps = sum(1 for _ in wiki_train_ds.as_numpy_iterator()) * EPOCHS
lr_schedule = tf.keras.optimizers.schedules.PolynomialDecay(
    initial_learning_rate=scaled_learning_rate,
    decay_steps=total_training_steps,
    end_learning_rate=0.0,
)

printed_rates = []  # (report) what PrintLR printed


class PrintLR(tf.keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        rate = model_dist.optimizer.learning_rate.numpy()
        print(f"\nLearning rate for epoch {epoch + 1} is {rate}")
        printed_rates.append(rate)


callbacks = [
    tf.keras.callbacks.TensorBoard(log_dir="./logs"),
    PrintLR(),
]

# -- The model, compiled and fit in the scope
with strategy.scope():
    # Everything that creates variables should be under the strategy scope.
    # In general this is only model construction & `compile()`.
    backbone = keras_hub.models.BertBackbone(  # (from_preset("bert_tiny_en_uncased"))
        vocabulary_size=VOCABULARY,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=SEQUENCE,
    )
    model_dist = keras_hub.models.BertMaskedLM(backbone, preprocessor=None)

    # This line just sets pooled_dense layer as non-trainiable, we do this to avoid
    # warnings of this layer being unused
    model_dist.get_layer("bert_backbone").get_layer("pooled_dense").trainable = False

    model_dist.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.AdamW(learning_rate=scaled_learning_rate),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
        jit_compile=False,
    )

    fit_history = model_dist.fit(
        wiki_train_ds, validation_data=wiki_val_ds, epochs=EPOCHS, callbacks=callbacks
    )

# -- Evaluated outside the scope
evaluated = model_dist.evaluate(wiki_test_ds)

report(
    {
        "total_training_steps": total_training_steps,
        "lr_schedule_end": float(lr_schedule(total_training_steps)),
        "fit": history(fit_history),
        "printed_learning_rates": printed_rates,
        "evaluate": evaluated,
        "weights": checksum(model_dist.get_weights()),
        "events": events("./logs"),
    }
)
