# fault_matrix: one kvshare-serve per fault (fake decoder and provider), each row asserting
# the reply equals --device cpu's, the stderr reason, the metric, and that nothing is left
# behind (docs/hybrid.md, "Fault matrix").
add_test(NAME fault_matrix
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/fault_matrix.py ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(fault_matrix PROPERTIES TIMEOUT 600 LABELS "integration;fault_matrix")
