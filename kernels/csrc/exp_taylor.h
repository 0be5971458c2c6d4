/* e^g for |g| <= ln(2) / 2 ~ 0.35 by its Taylor series to degree 7 (truncation below 1e-8
 * relative), in Horner form. A macro, so the scalar kernels and the 16-lane vector ones
 * (GCC / Clang vector extensions) share it: `g` is a float or a vector of floats. Each
 * caller splits x log2(e) = i + f, passes g = f ln 2 and puts 2^i into the exponent bits. */
#ifndef QSERVE_EXP_TAYLOR_H
#define QSERVE_EXP_TAYLOR_H

#define EXP_TAYLOR7(g)                                                                      \
    (((((((((g) * 1.98412698e-4f + 1.38888889e-3f) * (g) + 8.33333333e-3f) * (g)            \
          + 4.16666667e-2f) * (g) + 1.66666667e-1f) * (g) + 0.5f) * (g) + 1.0f) * (g))      \
     + 1.0f)

#endif
