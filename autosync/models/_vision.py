"""Image classifiers of the zoo: ResNet-50 and VGG-16 (dense-heavy, no embeddings).

Full variants are the ``keras.applications`` architectures (224x224, 1000 classes, no pretrained
weights); small variants keep the same structure at CIFAR scale (32x32, 10 classes).
"""
from __future__ import annotations

import keras


def classification_loss():
    """Cross-entropy on integer labels and logits."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def momentum_sgd(learning_rate: float = 0.1):
    """SGD with Nesterov-free momentum 0.9, the usual optimizer for these networks."""
    return keras.optimizers.SGD(learning_rate=learning_rate, momentum=0.9)


def resnet50_full(classes: int = 1000):
    """ResNet-50 v1 (25.6M parameters), random initial weights."""
    return keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3), classes=classes,
                                       classifier_activation=None)


def _basic_block(x, filters: int, stride: int, name: str):
    shortcut = x
    y = keras.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False, name=f"{name}_conv1")(x)
    y = keras.layers.BatchNormalization(name=f"{name}_bn1")(y)
    y = keras.layers.ReLU(name=f"{name}_relu1")(y)
    y = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"{name}_conv2")(y)
    y = keras.layers.BatchNormalization(name=f"{name}_bn2")(y)
    if stride != 1 or shortcut.shape[-1] != filters:
        shortcut = keras.layers.Conv2D(filters, 1, strides=stride, use_bias=False, name=f"{name}_proj")(shortcut)
        shortcut = keras.layers.BatchNormalization(name=f"{name}_proj_bn")(shortcut)
    y = keras.layers.Add(name=f"{name}_add")([y, shortcut])
    return keras.layers.ReLU(name=f"{name}_out")(y)


def resnet_small(classes: int = 10, widths: tuple[int, ...] = (16, 32, 64), image_size: int = 32):
    """A CIFAR-style ResNet: a 3x3 stem and one basic residual block per stage."""
    inputs = keras.Input((image_size, image_size, 3), name="image")
    x = keras.layers.Conv2D(widths[0], 3, padding="same", use_bias=False, name="stem_conv")(inputs)
    x = keras.layers.BatchNormalization(name="stem_bn")(x)
    x = keras.layers.ReLU(name="stem_relu")(x)
    for i, w in enumerate(widths):
        x = _basic_block(x, w, 1 if i == 0 else 2, name=f"stage{i + 1}")
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = keras.layers.Dense(classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="resnet_small")


def vgg16_full(classes: int = 1000):
    """VGG-16 (138M parameters, 124M of them in the two 4096-wide dense layers)."""
    return keras.applications.VGG16(weights=None, input_shape=(224, 224, 3), classes=classes,
                                    classifier_activation=None)


class Centre(keras.layers.Layer):
    """Pixels in [0, 1] to [-1, 1]: ``keras.layers.Rescaling(2.0, offset=-1.0)`` without its
    dependence on TensorFlow (a preprocessing layer needs it on every Keras backend), so the
    model also runs where compute is measured on Keras' torch backend."""

    def call(self, inputs):
        return inputs * 2.0 - 1.0


def vgg_small(classes: int = 10, image_size: int = 32, dense_units: int = 1024):
    """VGG at CIFAR scale: three conv blocks, then two wide dense layers that hold most of the
    parameters, as in VGG-16. Pixels in [0, 1] are centred first (VGG's mean subtraction): a
    plain ReLU stack without normalization does not start learning from uncentred inputs."""
    inputs = keras.Input((image_size, image_size, 3), name="image")
    x = Centre(name="centre")(inputs)
    for b, (filters, convs) in enumerate(((32, 2), (64, 2), (128, 2)), start=1):
        for c in range(1, convs + 1):
            x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu", name=f"block{b}_conv{c}")(x)
        x = keras.layers.MaxPooling2D(2, name=f"block{b}_pool")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    x = keras.layers.Dense(dense_units, activation="relu", name="fc1")(x)
    x = keras.layers.Dense(dense_units, activation="relu", name="fc2")(x)
    outputs = keras.layers.Dense(classes, name="predictions")(x)
    return keras.Model(inputs, outputs, name="vgg_small")
