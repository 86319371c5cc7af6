#include <stdio.h>
#include <stdlib.h>
#include "stats.h"

int main(int argc, char **argv) {
    int bins = argc > 1 ? atoi(argv[1]) : 10;
    long cap = 1024, n = 0;
    double *xs = malloc(cap * sizeof *xs), x;
    while (scanf("%lf", &x) == 1) {
        if (n == cap) xs = realloc(xs, (cap *= 2) * sizeof *xs);
        xs[n++] = x;
    }
    long *counts = calloc(bins, sizeof *counts);
    histogram(xs, n, bins, counts);
    printf("n %ld mean %.2f\n", n, mean(xs, n));
    for (int b = 0; b < bins; b++) printf("bin %d %ld\n", b, counts[b]);
    return 0;
}
