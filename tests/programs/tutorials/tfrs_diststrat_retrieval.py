"""Follows tensorflow/recommenders docs/examples/diststrat_retrieval.ipynb
("Recommending movies: retrieval with distribution strategy"), call for call.

MovieLens ratings reduced to (movie_title, user_id) and the movie titles;
``tf.random.set_seed(42)``, a fixed shuffle, a train/test split; the unique
titles and user ids; the strategy; in ``strategy.scope()``: the user and movie
models (``StringLookup`` + ``Embedding``), ``tfrs.metrics.FactorizedTopK`` over
the candidates ``movies.batch(128).map(movie_model)`` and
``tfrs.tasks.Retrieval``; a ``tfrs.Model`` subclass whose ``compute_loss``
calls the task, made and compiled with Adam in the scope; the training and
test data shuffled, batched and cached; ``fit`` for 3 epochs and
``evaluate(return_dict=True)``.

tfrs.Model's ``train_step`` / ``test_step`` return the loss tensors
themselves ("loss", "regularization_loss", "total_loss"), not Metric objects:
logs that Keras reduces over the replicas itself (under MirroredStrategy, the
sum of the two replicas' losses), which issue 32 found rank-local under
MPIStrategy.

Adapted (see _tutorial.py): the strategy line (and the notebook's two virtual
GPUs left out: _tutorial.py makes MirroredStrategy's two devices); no
download: ``tfds.load("movielens/100k-ratings")`` and
``("movielens/100k-movies")`` are synthetic ratings of the same features and
dtypes (400 ratings of 200 movies by 50 users, split 320/80 where the notebook
splits 100,000 as 80,000/20,000). Run with the working directory as argv[1]
and as the current directory.
"""

from _tutorial import SEED, begin, checksum, history, make_strategy, report

begin(keras="tf_keras")  # tensorflow-recommenders is written for Keras 2

import pprint

import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs


def movielens(split_name):  # (stands in for tfds.load("movielens/100k-...", split="train"))
    rng = np.random.default_rng(SEED)
    titles = np.array([f"Movie {i} ({1950 + i % 50})".encode() for i in range(200)])
    if split_name == "100k-movies":
        return tf.data.Dataset.from_tensor_slices(
            {"movie_id": np.arange(200).astype(str).astype(bytes), "movie_title": titles}
        )
    users = rng.integers(1, 51, 400)
    movie_of = (users * 7 + rng.integers(0, 40, 400)) % 200  # users prefer some movies
    return tf.data.Dataset.from_tensor_slices(
        {
            "movie_title": titles[movie_of],
            "user_id": users.astype(str).astype(bytes),
            "user_rating": rng.integers(1, 6, 400).astype(np.float32),
        }
    )


# -- Preparing the dataset
# Ratings data.
ratings = movielens("100k-ratings")
# Features of all the available movies.
movies = movielens("100k-movies")

for x in ratings.take(1).as_numpy_iterator():
    pprint.pprint(x)

for x in movies.take(1).as_numpy_iterator():
    pprint.pprint(x)

ratings = ratings.map(
    lambda x: {
        "movie_title": x["movie_title"],
        "user_id": x["user_id"],
    }
)
movies = movies.map(lambda x: x["movie_title"])

tf.random.set_seed(42)
shuffled = ratings.shuffle(100_000, seed=42, reshuffle_each_iteration=False)

train = shuffled.take(320)
test = shuffled.skip(320).take(80)

movie_titles = movies.batch(1_000)
user_ids = ratings.batch(1_000_000).map(lambda x: x["user_id"])

unique_movie_titles = np.unique(np.concatenate(list(movie_titles)))
unique_user_ids = np.unique(np.concatenate(list(user_ids)))

print(unique_movie_titles[:10])

# -- The strategy
strategy = make_strategy()

# -- Implementing a model
embedding_dimension = 32

with strategy.scope():
    user_model = tf.keras.Sequential(
        [
            tf.keras.layers.StringLookup(vocabulary=unique_user_ids, mask_token=None),
            # We add an additional embedding to account for unknown tokens.
            tf.keras.layers.Embedding(len(unique_user_ids) + 1, embedding_dimension),
        ]
    )

    movie_model = tf.keras.Sequential(
        [
            tf.keras.layers.StringLookup(vocabulary=unique_movie_titles, mask_token=None),
            tf.keras.layers.Embedding(len(unique_movie_titles) + 1, embedding_dimension),
        ]
    )

    metrics = tfrs.metrics.FactorizedTopK(candidates=movies.batch(128).map(movie_model))

    task = tfrs.tasks.Retrieval(metrics=metrics)


class MovielensModel(tfrs.Model):
    def __init__(self, user_model, movie_model):
        super().__init__()
        self.movie_model: tf.keras.Model = movie_model
        self.user_model: tf.keras.Model = user_model
        self.task: tf.keras.layers.Layer = task

    def compute_loss(self, features: dict[str, tf.Tensor], training=False) -> tf.Tensor:
        # We pick out the user features and pass them into the user model.
        user_embeddings = self.user_model(features["user_id"])
        # And pick out the movie features and pass them into the movie model,
        # getting embeddings back.
        positive_movie_embeddings = self.movie_model(features["movie_title"])

        # The task computes the loss and the metrics.
        return self.task(user_embeddings, positive_movie_embeddings)


# -- Fitting and evaluating
with strategy.scope():
    model = MovielensModel(user_model, movie_model)
    model.compile(optimizer=tf.keras.optimizers.Adam(learning_rate=0.1))

cached_train = train.shuffle(100_000).batch(8192).cache()
cached_test = test.batch(4096).cache()

fit_history = model.fit(cached_train, epochs=3)

evaluated = model.evaluate(cached_test, return_dict=True)
print(evaluated)

report(
    {
        "unique_movie_titles": len(unique_movie_titles),
        "unique_user_ids": len(unique_user_ids),
        "fit": history(fit_history),
        "evaluate": evaluated,
        "weights": checksum(model.get_weights()),
    }
)
