#ifndef WORDFREQ_H
#define WORDFREQ_H
#include <stddef.h>
#include <stdio.h>

typedef struct entry {
    char *word;
    long count;
    struct entry *next;
} entry;

typedef struct {
    entry **buckets;
    size_t nbuckets;
    size_t size;
} table;

void table_init(table *t, size_t nbuckets);
void table_add(table *t, const char *word);
entry **table_entries(const table *t);
void table_free(table *t);

/* next word of the stream (normalised), or NULL at the end; the buffer is reused */
const char *next_word(FILE *in);

void sort_entries(entry **entries, size_t n);
#endif
